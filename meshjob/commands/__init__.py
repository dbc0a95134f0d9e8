"""One module per `meshjob` subcommand: HELP, add_arguments(parser), run(args) -> int."""
