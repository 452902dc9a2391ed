"""The `ds4` command's wiring: each subcommand reaches its implementation with its flags."""

import json

import pytest

from ds4.cli import main


def test_make_tiny_writes_a_sharded_checkpoint_in_the_asked_format(tmp_path, capsys):
    assert main(["make-tiny", str(tmp_path / "m"), "--format", "hf", "--seed", "1"]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert "layer_types" in config and len(set(index["weight_map"].values())) >= 2
    assert "hf-format" in capsys.readouterr().out


def test_generate_prints_the_greedy_completion_of_the_built_in_model(capsys):
    from ds4 import LLM, SamplingParams

    assert main(["generate", "--prompt", "The capital of France is", "--max-tokens", "4", "--max-num-seqs", "2"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    expected = (
        LLM(max_num_seqs=2)
        .generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
        .text
    )
    assert printed == expected


def test_unknown_benchmark_and_bad_flags_are_refused(capsys):
    assert main(["bench", "nonsense"]) == 2
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--max-num-seqs", "many"])
