"""How fast ``fsdp2lab plan`` answers: Llama 3.1 70B at 256 ranks (FSDP 32 x TP 8) in under a
minute of CPU, and a cost per op of the memory tracker that does not grow with the model's depth
(its update of module peaks shown only the modules running), its statistics unchanged."""

from __future__ import annotations

import json
import resource

import pytest
from torch.distributed._tools.mem_tracker import MemTracker

from conftest import run_cli
from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.plan import resolve
from fsdp2lab.runtime.torch_compat import ActiveModulePeaks
from fsdp2lab.scale import simulate as sim

LLAMA_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False}  # fmt: skip
N_LAYERS = 6


def _traced(monkeypatch, flags: list[str]):
    """``simulate`` of a ``gpt`` plan on 4 ranks: (its RoleRun, the most module statistics the
    tracker's update was shown after one op, each module's statistics at the end)."""
    plan = resolve(config_from_args(build_parser().parse_args(["train", *flags])), 4, "cuda")
    shown, trackers = [0], []
    update = MemTracker._update_peak_stats

    def counted(self, peak_state):
        shown[0] = max(shown[0], len(list(self.memory_tracking.values())))
        return update(self, peak_state)

    make = sim.memory_tracker

    def kept(model, optimizer, offload=False):
        trackers.append(make(model, optimizer, offload))
        return trackers[-1]

    monkeypatch.setattr(MemTracker, "_update_peak_stats", counted)
    monkeypatch.setattr(sim, "memory_tracker", kept)
    run = sim.simulate(plan)
    modules = {s.mod_fqn: (s.local_peak, s.snapshots) for s in trackers[0].memory_tracking.values()}
    monkeypatch.undo()
    return run, shown[0], modules


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tp", "2"], ["--activation-checkpointing", "full"]])
def test_tracker_shows_only_running_modules_same_statistics(monkeypatch, layout):
    flags = ["--model", "gpt", "--n-layers", str(N_LAYERS), "--d-model", "64", "--n-heads", "4",
             "--seq-len", "32", "--batch-size", "2", "--optimizer", "adamw", *layout]  # fmt: skip
    run, shown, modules = _traced(monkeypatch, flags)
    assert len(modules) > N_LAYERS  # every block is an FSDP unit, the root one more
    assert shown <= 3, shown  # the root, a block (and the head where it is a unit of its own)
    monkeypatch.delattr(ActiveModulePeaks, "_update_peak_stats")  # torch's own: every module
    plain, shown_all, plain_modules = _traced(monkeypatch, flags)
    assert shown_all == len(plain_modules)
    assert run == plain
    assert modules == plain_modules


@pytest.mark.hf  # needs transformers: runs in the Hugging Face stage
def test_70b_at_256_ranks_under_a_minute_of_cpu(tmp_path):
    """The user and system CPU time of the ``fsdp2lab plan`` process (not wall time: the machine
    running the tests may be shared)."""
    import transformers

    transformers.LlamaConfig(**LLAMA_70B).save_pretrained(tmp_path)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = run_cli(["plan", "--model", f"hf:{tmp_path}", "--seq-len", "8192", "--batch-size",
                    "1", "--mixed-precision", "bf16", "--optimizer", "adamw",
                    "--activation-checkpointing", "full", "--world-size", "256", "--tp", "8",
                    "--gpu", "h100", "--json"], timeout=600)  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    report = json.loads(proc.stdout)
    assert report["mesh"] == {"dp_shard": 32, "tp": 8} and report["fits"] is True
    assert cpu < 60, f"{cpu:.1f} s of CPU"
