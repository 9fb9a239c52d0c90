"""Peak RSS of `keel export` against the largest tensor: the export streams, so it must not grow with the model.

Writes a tp-sharded checkpoint in DeepSpeed's ZeRO-0 layout (`mp_rank_<tp>_model_states.pt`, the files a tp run
saves) for a model with a large embedding, then, in a fresh process, resets the kernel's peak-RSS counter
(`/proc/self/clear_refs` 5) after the imports and runs the export. Prints the peak above that baseline next to
the largest tensor, the shard budget and the whole model; the bound is 2 × max(largest tensor, shard budget) +
a fixed 96 MiB: transformers' tokenizer and config code on first use (63 MiB measured), then either one shard's
tensors plus safetensors' serialized copy of them, or a tensor being assembled plus the memory-mapped source pages
it was copied from.

    python bench/export_memory.py [--dim 512] [--layers 4] [--vocab 32000] [--tp 2] [--shard-mib 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# measured 63 MiB: transformers' tokenizer and config code on first use (imports, protobuf)
FIXED_MIB = 96


def write_checkpoint(run_dir: Path, dim: int, layers: int, vocab: int, tp: int) -> dict:
    import torch
    import yaml

    from keel.config import build_config
    from keel.data.tokenizer import train_tokenizer
    from keel.model import CausalLM
    from keel.parallel.layer_parallel import LayerParallel
    from keel.run_dir import COMPLETE, LATEST, tag_for
    from keel.training.checkpoint.store import TrainState

    model = {
        "dim": dim,
        "n_layers": layers,
        "n_heads": 8,
        "n_kv_heads": 4,
        "vocab_size": vocab,
        "tie_embeddings": False,
    }
    cfg = build_config({"model": model, "parallel": {"tp": tp}})
    run_dir.mkdir(parents=True)
    filler = " the quick brown fox jumps over the lazy dog" * 3
    docs = [" ".join(f"w{(i * 7 + j) % 500}" for j in range(200)) + filler for i in range(50)]
    tokenizer = train_tokenizer(docs, 300, run_dir / "tok").model_path
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (run_dir / "ds_config.json").write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    (run_dir / "data.json").write_text(json.dumps({"tokenizer": str(tokenizer)}))
    tag_dir = run_dir / "checkpoints" / tag_for(1)
    tag_dir.mkdir(parents=True)
    total = 0
    for rank in range(tp):
        state = CausalLM(
            cfg.model, seed=0, parallel=LayerParallel.without_groups(tp=tp, tp_rank=rank)
        ).state_dict()
        torch.save({"module": state}, tag_dir / f"mp_rank_{rank:02d}_model_states.pt")
        total += sum(v.numel() * 4 for k, v in state.items())
        del state
    largest = vocab * dim * 4  # the unsharded embedding (and untied head): the largest tensor
    files = {p.name: p.stat().st_size for p in sorted(tag_dir.iterdir())}
    topology = {"world_size": tp, "tp": tp, "pp": 1, "dp": 1, "ep": 1, "sp": 1, "zero_stage": 0}
    (tag_dir / COMPLETE).write_text(
        json.dumps(
            {"tag": tag_for(1), **asdict(TrainState(step=1)), "topology": topology, "files": files}
        )
    )
    (run_dir / "checkpoints" / LATEST).write_text(tag_for(1))
    return {"largest_mib": largest / 2**20, "model_mib": total / 2**20}


_MEASURE = """
import json, sys
from pathlib import Path
from keel.tools.export.hf_export import export_hf
import safetensors.torch, transformers, sentencepiece  # every import before the baseline
def rss(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
Path('/proc/self/clear_refs').write_text('5')  # reset the peak (VmHWM) to the current RSS
base = rss('VmRSS')
export_hf(Path(sys.argv[1]), Path(sys.argv[2]), max_shard_bytes=int(float(sys.argv[3]) * 2**20))
print(json.dumps({'baseline_mib': base, 'peak_mib': rss('VmHWM')}))
"""


def measure(run_dir: Path, out_dir: Path, shard_mib: float) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(run_dir), str(out_dir), str(shard_mib)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(dim: int, layers: int, vocab: int, tp: int, shard_mib: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sizes = write_checkpoint(Path(tmp) / "run", dim, layers, vocab, tp)
        got = measure(Path(tmp) / "run", Path(tmp) / "hf", shard_mib)
    above = got["peak_mib"] - got["baseline_mib"]
    bound = 2 * max(sizes["largest_mib"], shard_mib) + FIXED_MIB
    return {
        **sizes,
        **got,
        "shard_mib": shard_mib,
        "peak_above_baseline_mib": above,
        "bound_mib": bound,
        "verdict": "PASS" if above <= bound else "FAIL",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--shard-mib", type=float, default=64)
    args = parser.parse_args()
    result = run(args.dim, args.layers, args.vocab, args.tp, args.shard_mib)
    print(
        " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items())
    )


if __name__ == "__main__":
    main()
