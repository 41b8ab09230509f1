"""`bridgelm params` reproduces the paper's Appendix B Bridge column, on the meta device."""

import re

import pytest
from conftest import tiny_model

from bridgelm.cli import main


def _rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells and re.match(r"^ds-|/", cells[0]):
            rows[cells[0]] = cells[1:]
    return rows


def test_paper_bridge_column(capsys):
    main(["params"])
    rows = _rows(capsys.readouterr().out)
    # Embed & Head, Attn, FF, Bridge, Orig. Total as printed in the paper
    assert rows["ds-qwen-1.5b"][:5] == ["0.47", "0.15", "1.16", "0.09", "1.78"]
    assert rows["ds-qwen-7b"][:6] == ["1.09", "0.82", "5.70", "0.21", "7.62", "7.82"]
    assert rows["ds-llama-8b"][:6] == ["1.05", "1.34", "5.64", "0.27", "8.03", "8.30"]


def test_pmatch_column_equals_bridge(capsys):
    main(["params", "--preset", "ds-qwen-7b", "--add", "pmatch"])
    assert _rows(capsys.readouterr().out)["ds-qwen-7b"][3] == "0.21"


def test_model_directory(tmp_path, capsys):
    tiny_model().config.save_pretrained(tmp_path)
    main(["params", "--model", str(tmp_path)])
    out = capsys.readouterr().out
    assert str(tmp_path) in out and "| Model (parameters in thousands) |" in out  # a tiny model: not 0.00 everywhere
    orig = float(_rows(out)[str(tmp_path)][4])  # Orig. Total, in thousands
    assert orig == pytest.approx(sum(p.numel() for p in tiny_model().parameters()) / 1e3, abs=0.01)


def test_unknown_preset(capsys):
    with pytest.raises(SystemExit):
        main(["params", "--preset", "gpt-5"])
    assert "unknown preset 'gpt-5'" in capsys.readouterr().err


def test_a_model_that_is_neither_a_folder_nor_a_hub_id_here(tmp_path, capsys, monkeypatch):
    """Offline, a name that is no folder here is one line naming it (params reads only the config)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as err:
        main(["params", "--model", "no-such-org/no-such-model"])
    msg = capsys.readouterr().err
    assert err.value.code == 2 and "Traceback" not in msg
    assert "model 'no-such-org/no-such-model': no such folder here" in msg


def test_blocks_of_a_meta_model_are_built_on_meta(monkeypatch):
    """The counts allocate nothing: the blocks of a meta model are built there, not drawn on the CPU and moved (64
    heads on a 7B config took 38 s, 10000 heads asked the CPU for 55 GB)."""
    import torch

    from bridgelm import attach
    from bridgelm.params import count, meta_model

    built_on = []
    make_block = attach.make_block

    def spy(*args, **kwargs):
        built_on.append(torch.get_default_device().type)
        return make_block(*args, **kwargs)

    monkeypatch.setattr(attach, "make_block", spy)
    row = count(meta_model(preset="ds-qwen-7b"), "ds-qwen-7b", num_heads=10000)
    assert set(built_on) == {"meta"} and len(built_on) == 28
    assert row.added == 28 * (3584 + 4 * 3584 * 10000 * 128)  # norm + q, k, v, o of 10000 heads of 128


def test_a_model_with_its_own_blocks_is_counted_with_them(tmp_path, capsys):
    """A trained run's folder (blocks saved with the model) is counted, not refused: its own blocks, named in the
    row, and the original parts as without them."""
    import bridgelm

    model = tiny_model()
    bridgelm.add_bridge(model, num_heads=2)
    model.save_pretrained(tmp_path / "with")
    tiny_model().save_pretrained(tmp_path / "without")
    main(["params", "--model", str(tmp_path / "with"), "--model", str(tmp_path / "without"), "--num-heads", "2"])
    rows = _rows(capsys.readouterr().out)
    own, fresh = rows[f"{tmp_path / 'with'} (its own bridge blocks, 2 heads)"], rows[str(tmp_path / "without")]
    assert own == fresh and float(own[3]) > 0  # every part, the blocks and the totals alike
    # the blocks' column is named after what it counts: a model's own P-Match blocks are not "Bridge" ones
    pmatch = tiny_model()
    bridgelm.add_pmatch(pmatch, num_heads=2)
    pmatch.save_pretrained(tmp_path / "pmatch")
    main(["params", "--model", str(tmp_path / "pmatch")])
    assert "| P-Match |" in capsys.readouterr().out
    main(["params", "--model", str(tmp_path / "pmatch"), "--model", str(tmp_path / "without")])
    assert "| Blocks |" in capsys.readouterr().out
