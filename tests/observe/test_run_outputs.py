"""The end-of-run summary names the trained model's folder: the newest weights version the run wrote."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from rllm.experimental.fully_async.observe.metrics_sink import run_outputs


def _cfg(weights_dir: Path) -> object:
    return OmegaConf.create({"param_sync": {"weights_dir": str(weights_dir)}, "trainer": {"logger": ["console"]}})


def test_the_summary_names_the_newest_weights_folder_and_says_what_it_holds(tmp_path):
    weights = tmp_path / "weights"
    for name in ("v2", "v10", "v9", ".tmp-v11-abcd"):  # numeric order, not text order; staging folders ignored
        (weights / name).mkdir(parents=True)
    outputs = dict(run_outputs(_cfg(weights), tmp_path, tmp_path / "checkpoints"))
    assert outputs["trained model"].startswith(f"{weights / 'v10'}  (Hugging Face format")

    (weights / "v10" / "adapter_config.json").write_text("{}")  # a LoRA run syncs adapters
    outputs = dict(run_outputs(_cfg(weights), tmp_path, tmp_path / "checkpoints"))
    assert "peft LoRA adapter" in outputs["trained model"]


def test_no_line_when_the_run_wrote_no_weights_folder(tmp_path):
    outputs = dict(run_outputs(_cfg(tmp_path / "none"), tmp_path, tmp_path / "checkpoints"))
    assert "trained model" not in outputs
