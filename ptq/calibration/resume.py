"""Finished blocks kept on disk, so that an interrupted quantization continues where it stopped.

After each block the runner gives the store the processed block (its QuantLinears'
buffers and any rescaled norms), what the report learnt about it, and the next block's
inputs. They are written into the store's folder (the work folder of
ptq.checkpoint.output), each file atomically, and `progress.json` last: only then does the
block count as finished. A resumed run rebuilds the finished blocks from these files and
starts the runner at the next block with its saved inputs, so it computes what the
uninterrupted run computed and writes a bit-identical checkpoint.

`run.json` records what the run is (recipe, model, calibration data, dtypes); a resume
with anything different is refused, naming what changed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ptq.errors import PtqError
from ptq.modules import QuantLinear


def fingerprint(tensor: Tensor) -> str:
    """sha256 of a tensor's bytes, with its shape and dtype."""
    data = tensor.detach().cpu().contiguous()
    digest = hashlib.sha256(f"{tuple(data.shape)} {data.dtype}".encode())
    digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def _write_atomically(path: Path, write) -> None:
    """write(temporary path), flushed to disk, then renamed over path."""
    temporary = path.with_name(path.name + ".tmp")
    write(temporary)
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, path)


class BlockStore:
    """The finished blocks of one run, in `folder` (created if missing)."""

    def __init__(self, folder: str | os.PathLike, identity: dict | None = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.identity = dict(identity or {})  # what the caller knows of the run (the model)
        self.finished = 0  # blocks finished, by an earlier run or this one

    def begin(self, identity: dict) -> int:
        """Record (or check against the earlier run) what this run is; the finished block count."""
        identity = {**self.identity, **identity}
        record = self.folder / "run.json"
        if record.exists():
            earlier = json.loads(record.read_text())
            changed = [key for key in sorted(earlier.keys() | identity.keys()) if earlier.get(key) != identity.get(key)]
            if changed:
                raise PtqError(
                    f"cannot resume from '{self.folder.parent}': the interrupted run had a different "
                    f"{changed[0].replace('_', ' ')}; rerun it as it was, or remove that folder to start over"
                )
        else:
            _write_atomically(record, lambda p: p.write_text(json.dumps(identity, indent=2) + "\n"))
        progress = self.folder / "progress.json"
        self.finished = json.loads(progress.read_text())["finished_blocks"] if progress.exists() else 0
        return self.finished

    def save_block(self, index: int, block: nn.Module, record: dict, inputs: list[Tensor]) -> None:
        """Block `index` is done: keep its tensors, its report `record` and the next inputs."""
        assert index == self.finished, f"blocks are saved in order: expected {self.finished}, got {index}"
        state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in block.state_dict().items()}
        _write_atomically(self._path(index, "safetensors"), lambda p: save_file(state, p))
        _write_atomically(self._path(index, "json"), lambda p: p.write_text(json.dumps(record, indent=2) + "\n"))
        hidden = {f"batch.{i}": h.detach().to("cpu", copy=True).contiguous() for i, h in enumerate(inputs)}
        _write_atomically(self.folder / "inputs.safetensors", lambda p: save_file(hidden, p))
        self.finished = index + 1
        progress = json.dumps({"finished_blocks": self.finished}) + "\n"
        _write_atomically(self.folder / "progress.json", lambda p: p.write_text(progress))

    def load_block(self, index: int) -> tuple[dict[str, Tensor], dict]:
        """The tensors (block-relative names) and the report record of finished block `index`."""
        return load_file(self._path(index, "safetensors")), json.loads(self._path(index, "json").read_text())

    def load_inputs(self) -> list[Tensor]:
        """The inputs of the first unfinished block: the hidden states of each batch."""
        tensors = load_file(self.folder / "inputs.safetensors")
        return [tensors[f"batch.{i}"] for i in range(len(tensors))]

    def _path(self, index: int, suffix: str) -> Path:
        return self.folder / f"block-{index:05d}.{suffix}"


def restore_blocks(model: nn.Module, blocks_path: str, batches, step, report, store: BlockStore) -> dict:
    """Rebuild the blocks an earlier run finished (QuantLinears of step's scheme, their
    state and what the report learnt about them); run_blocks' arguments to go on from there."""
    identity = {
        "recipe": report.recipe.to_yaml(),
        "calibration_data": fingerprint(batches),
        **report.settings(),
    }
    finished = store.begin(identity)
    if not finished:
        return {}
    blocks = model.get_submodule(blocks_path)
    for index in range(finished):
        state, record = store.load_block(index)
        block = blocks[index]
        for name, meta in record["modules"].items():
            linear = block.get_submodule(name)
            module = QuantLinear.empty_like(linear, step.scheme, scale_dtype=report.checkpoint_dtype,
                                            has_g_idx=f"{name}.weight_g_idx" in state)
            module.actorder, module.observer = meta["actorder"], meta["observer"]
            block.set_submodule(name, module)
            linear.to("meta")
        block.load_state_dict(state, strict=True, assign=True)
        report.layers.update(record["layers"])
        report.notes.extend(note for note in record["notes"] if note not in report.notes)
        report.smoothing.update(record["smoothing"])
    report.notes.append(f"resumed: blocks 0 to {finished - 1} were finished by an interrupted run")
    return {"start": finished, "start_hidden": store.load_inputs()}
