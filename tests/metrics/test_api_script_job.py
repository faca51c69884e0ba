"""A user's script, as they write it: the model factory and the dataset class defined in the
script itself (`__main__`), a configured dataset instance, `unbroken.run_job(...)` under the
`__main__` guard, a kill during the update and the fault-free reference. The trainers import
the script by its file name; the recovered run must be bit-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch import nn
    import unbroken
    from unbroken.config import (CheckpointConfig, DataConfig, JobConfig, ParallelConfig,
                                 ProtectionConfig, RecoveryConfig, TrainConfig)

    class Bigram(nn.Module):
        def __init__(self, vocab):
            super().__init__()
            self.table = nn.Embedding(vocab, vocab)

        def forward(self, batch):
            return nn.functional.cross_entropy(self.table(batch["x"]), batch["y"])

    def make_model(vocab=32):
        return Bigram(vocab)

    class Steps:
        def __init__(self, seed, rows):
            self.seed, self.rows = seed, rows

        def iteration(self, iteration, shard):
            gen = torch.Generator().manual_seed(self.seed + 7919 * iteration + 31 * shard)
            x = torch.randint(0, 32, (self.rows,), generator=gen)
            return [{"x": x, "y": (x + 1) % 32}, {"x": x, "y": (x + 2) % 32}]

    if __name__ == "__main__":
        cfg = JobConfig(
            data=DataConfig(tokens_per_microbatch=16, microbatches=2),
            train=TrainConfig(iterations=8),
            parallel=ParallelConfig(world_size=2),
            checkpoint=CheckpointConfig(interval=3),
            recovery=RecoveryConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=1.5),
            protection=ProtectionConfig(page_bytes=8192, stripe_pages=2, parity_pages=3,
                                        chunk_bytes=2048),
            inject=["kill:rank=1,iter=5,phase=update"],
        )
        s = unbroken.run_job(cfg, sys.argv[1], model_factory=make_model,
                             dataset=Steps(seed=11, rows=16), optimizer="adamw",
                             reference=True, quiet=True)
        print(json.dumps({"bit_exact": s.bit_exact, "recovered": s.failures_recovered,
                          "state": s.state, "mode": [r.mode for r in s.recoveries]}))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_script_of_its_own_recovers_bit_exact(tmp_path):
    script = tmp_path / "my_training.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "UNBROKEN_JOB_SECRET"}
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=880,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"bit_exact": True, "recovered": 1, "state": "done", "mode": ["inplace"]}
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["model"]["factory"] == "my_training:make_model"
    assert config["data"]["dataset"].startswith("unbroken_dataset_")
