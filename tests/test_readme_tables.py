"""The README's results table and bench/README.md's tables are generated from bench/results/*.json
(meshjob_bench.readme_tables): the committed files are what the JSON say, every cell moves with its JSON, and the
generator reads JSON only (no torch, nothing of the trainer)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meshjob_bench import readme_tables

ROOT = Path(__file__).resolve().parents[1]
USED = ("resharding", "pipeline", "e2e", "cluster", "memory", "peers", "grad_sync", "operator", "tune")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of the files the generator reads and writes."""
    for name in readme_tables.TABLES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "bench" / "results").mkdir(parents=True, exist_ok=True)
    for name in USED:
        shutil.copy(ROOT / "bench" / "results" / f"{name}.json", tmp_path / "bench" / "results" / f"{name}.json")
    return tmp_path


def test_the_committed_tables_are_the_json_s():
    for path, text in readme_tables.generated(ROOT).items():
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)}: its tables differ from bench/results/*.json; "
            "run `python -m meshjob_bench.readme_tables --write`"
        )


def test_the_readme_has_one_results_table_between_its_markers():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("<!-- results: begin -->") : text.index("<!-- results: end -->")]
    assert table.count("\n|---") == 1  # one header separator: one table
    assert "Machine:" in table and "gbit" in table and "mbit" in table  # the machine and the NIC rates


def test_every_headline_cell_comes_from_its_json(checkout: Path):
    results = checkout / "bench" / "results"
    resharding = json.loads((results / "resharding.json").read_text())
    resharding["summary"]["paper_scale"]["broadcast K=auto greedy"]["over_limit"] = 9.87
    resharding["machine"] = {"torch": "9.9", "cpus": 64}
    (results / "resharding.json").write_text(json.dumps(resharding))
    pipeline = json.loads((results / "pipeline.json").read_text())
    for row in pipeline["rows"]:
        if row["variant"] == "eager-1f1b+wdelay" and row["model"] == "gpt" and row["stages_count"] == 8:
            row["vs_1f1b"] = 7.65
    (results / "pipeline.json").write_text(json.dumps(pipeline))
    e2e = json.loads((results / "e2e.json").read_text())
    e2e["nic_rate"] = "250mbit"
    e2e["rows"][0]["vs_alpa"] = 5.43
    (results / "e2e.json").write_text(json.dumps(e2e))
    peers = json.loads((results / "peers.json").read_text())
    peers["targets"][0]["ours_over_torch_best"] = 3.21
    (results / "peers.json").write_text(json.dumps(peers))
    tune = json.loads((results / "tune.json").read_text())
    tune["hand_written"]["cases"][0]["hand_over_tuned"] = 6.54
    (results / "tune.json").write_text(json.dumps(tune))

    readme = readme_tables.generated(checkout)[checkout / "README.md"]
    assert "3.210x" in readme and "6.54x" in readme
    assert "| 9.87 / " in readme
    assert "7.65x" in readme
    assert "5.43x" in readme and "250 mbit (tbf" in readme
    assert "| machine |" in readme and "64 CPUs, torch 9.9" in readme  # two machines: a column, not one line


def test_print_leaves_the_files_and_write_updates_them(checkout: Path, capsys: pytest.CaptureFixture[str]):
    readme = checkout / "README.md"
    readme.write_text(readme.read_text().replace("| `bench e2e`", "| typed by hand", 1))
    stale = readme.read_text()
    assert readme_tables.main(["--root", str(checkout)]) == 0
    assert "<!-- results -->" in capsys.readouterr().out and readme.read_text() == stale
    assert readme_tables.main(["--root", str(checkout), "--write"]) == 0
    assert "updated README.md" in capsys.readouterr().out
    assert "typed by hand" not in readme.read_text()
    assert readme.read_text() == readme_tables.generated(checkout)[readme]


def test_a_file_without_its_markers_is_an_error_naming_them(checkout: Path):
    readme = checkout / "README.md"
    readme.write_text(readme.read_text().replace("<!-- results: end -->", ""))
    with pytest.raises(ValueError, match="results: begin"):
        readme_tables.generated(checkout)


def test_rates_read_as_people_compare_them():
    assert readme_tables.rate("1gbit") == "1 gbit"
    assert readme_tables.rate("615807kbit") == "616 mbit"
    assert readme_tables.rates(["615807kbit", "205269kbit"]) == "616 / 205 mbit"
    assert readme_tables.rates(["1gbit", "500mbit"]) == "1 gbit / 500 mbit"


def test_the_generator_imports_no_torch_and_nothing_of_the_trainer():
    code = (
        "import sys, meshjob_bench.readme_tables\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'meshjob_trainer'))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
