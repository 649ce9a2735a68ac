"""``megatron-earl plan``: Qwen2.5-7B and -72B at 32 and 128 GPUs of 80 GB change layout between
4K and 64K contexts, with memory predictions; model files, JSON output and bad input."""

from __future__ import annotations

import json

import pytest
import yaml

from megatron_earl.selector.plan_cli import KNOWN_MODELS, main, parse_context, plan


@pytest.mark.parametrize("name", ["qwen2.5-7b", "qwen2.5-72b"])
@pytest.mark.parametrize("gpus", [32, 128])
def test_layout_changes_between_4k_and_64k(name, gpus, capsys):
    assert main(["--model", name, "--gpus", str(gpus), "--gpu-memory", "80", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {(r["context"], r["phase"]): r for r in result["rows"]}
    changed = [
        phase
        for phase in ("rollout", "experience", "train")
        if rows[(4096, phase)]["layout"] != rows[(65536, phase)]["layout"]
    ]
    assert changed, f"{name} on {gpus} GPUs: no phase changes layout between 4K and 64K"
    for phase in changed:
        for context in (4096, 65536):
            row = rows[(context, phase)]
            if row["layout"] is not None:
                assert 0 < row["memory_gb"] <= 80 / 1.1 and row["tokens_per_s"] > 0
    # the layout chosen at 4K, kept static, would run out of memory at 64K
    first = rows[(4096, changed[0])]["layout"]
    static = next(s for s in result["static"] if s["layout"] == first and s["phase"] == changed[0])
    assert "65536" in {str(c) for c in static["oom_at"]}


def test_table_output_names_layouts_memory_and_static_ooms(capsys):
    main(["--model", "Qwen2.5-7B", "--gpus", "32", "--gpu-memory", "80", "--context", "4k,64k"])
    out = capsys.readouterr().out
    assert "plan: Qwen2.5-7B on 32 GPUs x 80 GB" in out
    assert "mem/GPU GiB" in out and "tokens/s" in out
    assert "tp1cp1pp1dp32" in out and "would OOM at:" in out and "65536 (" in out


def test_model_file_and_run_config(tmp_path):
    shape = KNOWN_MODELS["qwen2.5-7b"].to_dict()
    flat = tmp_path / "model.json"
    flat.write_text(json.dumps(shape))
    nested = tmp_path / "run.yaml"
    nested.write_text(yaml.safe_dump({"name": "x", "model": shape}))
    for path in (flat, nested):
        assert (
            main(
                [
                    "--model",
                    str(path),
                    "--gpus",
                    "8",
                    "--gpu-memory",
                    "80",
                    "--context",
                    "4k",
                    "--phase",
                    "train",
                ]
            )
            == 0
        )


def test_too_small_for_any_layout_reports_the_smallest():
    result = plan(KNOWN_MODELS["qwen2.5-72b"], 8, 80, [65536], ["train"])
    row = result["rows"][0]
    assert row["layout"] is None and row["num_oom"] == row["num_candidates"]
    assert "the smallest is" in row["error"] and "GiB per rank" in row["error"]


def test_bad_input():
    assert parse_context("4k, 8K,32768") == [4096, 8192, 32768]
    with pytest.raises(SystemExit, match="cannot parse"):
        parse_context("4kb")
    with pytest.raises(SystemExit, match="neither a known model"):
        main(["--model", "gpt-9", "--gpus", "8", "--gpu-memory", "80"])
    with pytest.raises(SystemExit):
        main(["--model", "qwen2.5-7b", "--gpus", "8", "--gpu-memory", "80", "--phase", "decode"])
