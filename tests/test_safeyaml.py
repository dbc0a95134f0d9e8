"""meshjob.spec.safeyaml: manifests are read within bounds, with kubectl's scalars, refusing duplicate keys."""

from __future__ import annotations

import math
import time

import pytest

from meshjob.errors import FieldError, SpecError, short
from meshjob.spec.safeyaml import LIMITS, Limits, check_tree, load_documents, load_one, resolve_plain


def refusal(text: str, limits: Limits = LIMITS) -> FieldError:
    with pytest.raises(SpecError) as info:
        load_documents(text, "job.yaml", limits)
    assert len(info.value.errors) == 1
    return info.value.errors[0]


def billion_laughs(levels: int = 9, width: int = 9) -> str:
    """Each level an anchored list of `width` aliases of the level below: width**levels leaves."""
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


# --- kubectl's scalars -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        ("1e-3", 0.001),
        ("1E3", 1000.0),
        (".5", 0.5),
        ("-.5e1", -5.0),
        ("3.0e-4", 3e-4),
        ("1_000.5", 1000.5),
    ],
)
def test_exponents_without_a_dot_and_leading_dots_are_floats(text, value):
    assert resolve_plain(text) == value and isinstance(resolve_plain(text), float)


@pytest.mark.parametrize(
    "text, value",
    [
        ("12", 12),
        ("+12", 12),
        ("-0x10", -16),
        ("0x1F", 31),
        ("0o17", 15),
        ("0b101", 5),
        ("0777", 511),
        ("1_000", 1000),
        ("00", 0),
        ("9223372036854775808", 2**63),
    ],
)
def test_integers_take_go_prefixes_octal_zero_and_underscores(text, value):
    assert resolve_plain(text) == value and type(resolve_plain(text)) is int


@pytest.mark.parametrize("text", ["y", "Y", "yes", "Yes", "YES", "on", "On", "ON", "true", "True", "TRUE"])
def test_yaml_1_1_true_words_are_true_as_under_kubectl(text):
    assert resolve_plain(text) is True


@pytest.mark.parametrize("text", ["n", "N", "no", "No", "NO", "off", "Off", "OFF", "false", "False", "FALSE"])
def test_yaml_1_1_false_words_are_false_as_under_kubectl(text):
    assert resolve_plain(text) is False


@pytest.mark.parametrize("text", ["~", "null", "Null", "NULL", ""])
def test_null_words_are_none(text):
    assert resolve_plain(text) is None


@pytest.mark.parametrize("text", ["1e400", "1" * 400, "2001-12-14", "1:30", "0x", "0o", "12e", "yEs", "auto"])
def test_what_go_cannot_read_as_a_number_or_boolean_stays_a_string(text):
    assert resolve_plain(text) == text


def test_integers_beyond_64_bits_become_floats_as_in_go():
    assert resolve_plain("1" + "0" * 39) == 1e39


def test_special_floats():
    assert resolve_plain(".inf") == math.inf and resolve_plain("-.Inf") == -math.inf
    assert math.isnan(resolve_plain(".nan"))


def test_quoted_and_str_tagged_scalars_stay_strings():
    assert load_documents("a: '12'\nb: \"on\"\nc: !!str 1e3\nd: |\n  yes\n") == [
        {"a": "12", "b": "on", "c": "1e3", "d": "yes\n"}
    ]


def test_core_tags_convert_and_other_tags_are_refused():
    assert load_documents("a: !!int '13'\nb: !!float 1\nc: !!bool 'on'\nd: !!null ''\n") == [
        {"a": 13, "b": 1.0, "c": True, "d": None}
    ]
    assert "not supported" in refusal("a: !!binary aGVsbG8=\n").allowed
    assert "not supported" in refusal("a: !!python/object:os.system x\n").allowed
    assert "not a valid !!int" in refusal("a: !!int twelve\n").allowed


def test_mapping_keys_become_json_strings_as_under_kubectl():
    assert load_documents("1: a\non: b\n1.5: c\nn: d\n") == [{"1": "a", "true": "b", "1.5": "c", "false": "d"}]


def test_null_and_collection_keys_are_refused():
    assert "mapping keys" in refusal("~: x\n").allowed
    assert "mapping keys" in refusal("? [1, 2]\n: x\n").allowed


# --- structure -----------------------------------------------------------------------------------


def test_duplicate_key_is_refused_naming_its_path_and_line():
    error = refusal("spec:\n  model:\n    layers: 8\n    hidden: 4\n    layers: 9\n")
    assert error.path == "job.yaml:5:5"
    assert error.value == "spec.model.layers" and "given twice" in error.allowed


def test_duplicate_key_inside_a_list_names_the_index():
    assert refusal("spec:\n  stages:\n    - {layers: [0, 1], layers: [1, 2]}\n").value == "spec.stages[0].layers"


def test_keys_that_resolve_alike_are_duplicates():
    assert refusal("on: 1\ntrue: 2\n").value == "true"


def test_merge_keys_merge_under_explicit_keys_and_earlier_sources_win():
    text = "base: &b {p: 1, q: 2}\nd: {<<: *b, q: 3}\ne: {<<: [{x: 1}, {x: 2, z: 3}], w: 0}\n"
    doc = load_documents(text)[0]
    assert doc["d"] == {"p": 1, "q": 3}
    assert doc["e"] == {"x": 1, "z": 3, "w": 0}


def test_merging_something_other_than_mappings_is_refused():
    assert "mappings to merge" in refusal("a: {<<: [1, 2]}\n").allowed


def test_aliases_share_their_anchors_value():
    assert load_documents("a: &x [1, 2]\nb: *x\n") == [{"a": [1, 2], "b": [1, 2]}]


def test_an_alias_of_its_own_node_or_an_unknown_anchor_is_refused():
    assert "defined earlier" in refusal("a: &x [*x]\n").allowed
    assert "defined earlier" in refusal("a: *nowhere\n").allowed


def test_several_documents_load_in_order_and_empty_ones_are_skipped():
    assert load_documents("---\na: 1\n---\n---\nb: 2\n...\n") == [{"a": 1}, {"b": 2}]


def test_load_one_refuses_several_documents_and_none():
    with pytest.raises(SpecError, match="2 documents.*exactly one hosts"):
        load_one("a: 1\n---\nb: 2\n", "h.yaml", "hosts")
    with pytest.raises(SpecError, match="0 documents"):
        load_one("# nothing\n", "h.yaml", "hosts")


def test_syntax_errors_name_line_and_column():
    error = refusal("a: [1, 2\n")
    assert error.path == "job.yaml:2:1" and error.allowed == "valid YAML"


@pytest.mark.parametrize("text", ["a: \x00b\n", "a: 'x\x07'\n", "a: \ud800\n"])
def test_control_characters_and_lone_surrogates_are_refused(text):
    refusal(text)


# --- bounds ---------------------------------------------------------------------------------------


def test_alias_bomb_is_refused_fast_without_expanding():
    text = billion_laughs()  # 9**9 = 387 million leaves in about 300 bytes
    started = time.process_time()
    error = refusal(text)
    assert time.process_time() - started < 1.0  # a fixed bound far above the ~1 ms it takes
    assert f"at most {LIMITS.max_nodes} values" in error.allowed


def test_aliases_beyond_the_alias_budget_are_refused():
    text = "a: &a 1\nb: [" + ", ".join(["*a"] * (LIMITS.max_aliases + 1)) + "]\n"
    assert f"at most {LIMITS.max_aliases} aliases" in refusal(text).allowed


def test_500_levels_of_flow_nesting_are_refused_at_the_depth_limit():
    error = refusal("a: " + "[" * 500 + "]" * 500 + "\n")
    assert f"at most {LIMITS.max_depth} levels" in error.allowed
    assert error.path == f"job.yaml:1:{3 + LIMITS.max_depth}"  # the mapping is level 1: the 64th [ is refused


def test_deep_block_nesting_is_refused_too():
    text = "".join(" " * i + f"k{i}:\n" for i in range(200)) + " " * 200 + "v\n"
    assert "levels of nesting" in refusal(text).allowed


def test_nesting_up_to_the_limit_loads():
    depth = LIMITS.max_depth
    assert load_documents("[" * depth + "]" * depth)


def test_many_values_are_refused_beyond_the_node_budget():
    small = Limits(max_nodes=10)
    assert "at most 10 values" in refusal("[" + ", ".join(["1"] * 10) + "]", small).allowed


def test_too_many_documents_are_refused():
    assert "at most 2 documents" in refusal("a: 1\n---\nb: 1\n---\nc: 1\n", Limits(max_documents=2)).allowed


def test_oversized_text_is_refused_before_parsing():
    assert "at most 10" in refusal("a: 12345678901\n", Limits(max_bytes=10)).allowed


def test_check_tree_refuses_deep_parsed_documents_without_recursion():
    doc: list = []
    node = doc
    for _ in range(10_000):  # far past Python's recursion limit
        node.append([])
        node = node[0]
    with pytest.raises(SpecError, match="levels of nesting"):
        check_tree(doc)


def test_check_tree_refuses_cycles_as_too_large():
    doc: dict = {}
    doc["self"] = doc
    with pytest.raises(SpecError, match=r"at most \d+ levels|at most \d+ values"):
        check_tree(doc)


def test_check_tree_accepts_ordinary_documents():
    check_tree({"spec": {"stages": [{"mesh": [1, 2]}] * 100}})


# --- messages --------------------------------------------------------------------------------------


def test_error_values_are_truncated():
    assert len(short("x" * 1_000_000)) < 100
    assert len(short(list(range(1_000_000)))) < 100
    assert len(short(10**100_000)) < 100  # Python cannot even print this one as decimal
    nested: list = [1]
    for _ in range(50):
        nested = [nested, nested]  # 2**50 leaves, shared
    assert len(short(nested)) < 100


def test_error_paths_from_huge_keys_are_truncated():
    error = refusal("k" * 100_000 + ": 1\n" + "k" * 100_000 + ": 2\n")
    assert len(str(error)) < 400


def test_dump_yaml_reads_back_the_same_values_where_pyyaml_would_not():
    import yaml

    from meshjob.spec.safeyaml import dump_yaml

    doc = {
        "y": "y",
        "on": "on",
        "octal": "0o17",
        "exp": "1e3",
        "dot": ".5",
        "empty": "",
        "date": "2001-12-14",
        "plain": "gpt",
        "n": 3,
        "f": 0.001,
        "b": False,
        "none": None,
        "list": ["n", "S0RR", "0777"],
    }
    assert load_documents(yaml.safe_dump(doc)) != [doc]  # PyYAML writes y, 0o17 and 1e3 plain
    assert load_documents(dump_yaml(doc)) == [doc]
    assert "plain: gpt" in dump_yaml(doc)  # ordinary strings stay unquoted
