"""The memory tier across a change of width (issue 46): a node lost for good, or one that returns, resumes from the
snapshot in node memory cut again for the workers there are, bit for bit as a run stopped at that step and
relaunched on them from a stored checkpoint; and HYBRID_SHARD's replicas standing in for a lost group, with each
rank's own metrics. tests/memory_tier_support.py says how nodes and faults are stood in for."""

import shutil

import pytest
import torch
from conftest import final_weights, model_file, run_config, step_losses
from memory_tier_support import (
    FAULT_AT,
    assert_same_run,
    continue_copy,
    faulted_run,
    launch_on_nodes,
    launch_two_a_node,
    memory_config,
    node_dir,
)

from raysft.checkpoint.memory.reshard import chunk_rows
from raysft.launch.torchrun import launch
from raysft.training.metrics import read_metrics


def resumes(cfg) -> list[tuple[int, str | None, int]]:
    return [(m["step"], m.get("tier"), m["world_size"]) for m in read_metrics(cfg.run_dir)
            if m.get("event") == "resume"]


def stopped_and_relaunched(tmp_path, legs, **sets):
    """The reference of a change of width: the run stopped at a step on one pool, relaunched from its stored
    (full) checkpoint on another: (pool, launch function, extra sets) per leg. Its losses and final weights."""
    cfg = None
    for pool, fn, leg in legs:
        cfg = run_config(tmp_path / "reference", "reference", **{"checkpoint.mode": "full", **sets, **leg})
        pool.run(fn, cfg)
    return sorted(step_losses(cfg.run_dir)), final_weights(cfg.run_dir, tmp_path / "reference-hf")


# A model whose rows do not divide the widths: at 4 places q_proj's 42 rows are cut 11, 11, 11, 9, k_proj's 14 are
# 4, 4, 4, 2, and the MLP's 6 are 2, 2, 2 and none (torch.chunk's cut, as FSDP2 shards); at 2 places, 21, 7 and 3
UNEVEN = {"hidden_size": 42, "num_attention_heads": 3, "num_key_value_heads": 1, "intermediate_size": 6,
          "num_hidden_layers": 2}


def test_the_rows_of_each_place_are_torch_chunks_where_they_do_not_divide_and_empty_past_them():
    for rows in range(13):
        for places in range(1, 9):
            chunks = [(int(c[0]), int(c[-1]) + 1) for c in torch.arange(rows).chunk(places)] if rows else []
            expected = chunks + [(rows, rows)] * (places - len(chunks))
            assert [chunk_rows(rows, places, k) for k in range(places)] == expected, (rows, places)


@pytest.fixture(scope="module")
def uneven(gloo_pool, tmp_path_factory):
    """conftest's `faulted` on the UNEVEN model: 2 ranks, each on a node of its own, rank 1 dead after step 8."""
    tmp = tmp_path_factory.mktemp("uneven")
    sets = {"model.config": model_file(tmp / "model", **UNEVEN)}
    return faulted_run(gloo_pool, tmp, **sets), sets


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_a_run_that_grows_from_2_to_4_workers_resumes_from_memory_cut_again(tmp_path, gloo_pool, gloo_pool4, uneven):
    """Rank 1 of 2 died after step 8; the run comes back on 4 workers, 2 of them on a new node with nothing in
    its memory. Each new rank reads the rows it needs from the old parts (ranks 2 and 3 from rank 1's, sent to
    their node once), on a model whose rows are cut unevenly and, for one rank, not at all (UNEVEN), and the run
    equals the 2-worker run stopped at step 8 and relaunched on 4, bit for bit."""
    faulted, sets = uneven
    cfg = continue_copy(faulted, tmp_path, **{"scaling.num_workers": 4, **sets})
    shutil.rmtree(node_dir(cfg, "node1"))
    gloo_pool4.run(launch_on_nodes, cfg, ["node0", "node0", "node1", "node1"])
    assert resumes(cfg) == [(FAULT_AT, "memory", 4)]
    reference = stopped_and_relaunched(tmp_path, [(gloo_pool, launch, {"train.stop_at_step": FAULT_AT}),
                                                  (gloo_pool4, launch, {"scaling.num_workers": 4})], **sets)
    assert_same_run(cfg, reference, tmp_path / "hf")


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_a_resume_on_fewer_workers_without_every_shard_held_is_refused_by_name(tmp_path, gloo_pool, gloo_pool4):
    """4 workers, 2 a node, FULL_SHARD: node 1 is lost for good, and with it the only copies of ranks 2 and 3's
    parts (node 0's copies gone too). No new cut can be made without their rows: the log says whose, and the run
    resumes on 2 workers from the stored checkpoint."""
    cfg = memory_config(tmp_path, "lost", **{"scaling.num_workers": 4})
    with pytest.raises(RuntimeError, match=r"died .*\{2: 9, 3: 9\}"):
        gloo_pool4.run(launch_on_nodes, cfg, ["node0", "node0", "node1", "node1"], False, FAULT_AT, (2, 3))
    shutil.rmtree(node_dir(cfg, "node1"))
    for copy in node_dir(cfg, "node0").glob("step_*/rank_[23].safetensors"):
        copy.unlink()
    cfg = memory_config(tmp_path, "lost", **{"scaling.num_workers": 2})
    gloo_pool.run(launch_on_nodes, cfg, ["node0", "node0"])
    [not_used] = [m for m in read_metrics(cfg.run_dir) if m.get("event") == "memory_tier_not_used"]
    assert not_used["reason"].startswith(f"no node holds rank 2's part of step {FAULT_AT} (nor a copy of it)")
    assert resumes(cfg) == [(6, None, 2)]


HYBRID = {"parallel.sharding": "HYBRID_SHARD", "scaling.num_workers": 4, "train.log_every_n_steps": 5}
LOGGED = ("loss", "grad_norm", "tokens", "computed_tokens", "lr", "skipped_steps")


def logged_rows(cfg) -> dict[int, dict]:
    """Each step's logged metrics, the last pass's (a step trained again after a resume is logged again)."""
    return {m["step"]: {k: m[k] for k in LOGGED} for m in read_metrics(cfg.run_dir) if "loss" in m}


@pytest.fixture(scope="module")
def hybrid(gloo_pool, gloo_pool4, tmp_path_factory):
    """HYBRID_SHARD, 2 nodes of 2, metrics logged every 5 steps: a run whose node 1 died as its ranks wrote step 8
    (node 0's parts of it are whole: replicas, no copies sent), and the reference run stopped at step 8 and
    relaunched on 2 workers, FULL_SHARD, from its stored checkpoint."""
    tmp = tmp_path_factory.mktemp("hybrid")
    faulted = memory_config(tmp, "hybrid", **HYBRID)
    with pytest.raises(RuntimeError, match=r"died .*[{ ][23]: 9"):
        gloo_pool4.run(launch_two_a_node, faulted, FAULT_AT)
    assert not list(node_dir(faulted, "node0").glob("step_*/rank_[23].safetensors"))
    shutil.rmtree(node_dir(faulted, "node1"))  # lost for good, with its memory
    reference = run_config(tmp / "reference", "reference", **{"checkpoint.mode": "full", **HYBRID,
                                                              "train.stop_at_step": FAULT_AT})
    gloo_pool4.run(launch_two_a_node, reference)
    stopped_rows = logged_rows(reference)
    reference = run_config(tmp / "reference", "reference", **{"checkpoint.mode": "full", **HYBRID,
                                                              "parallel.sharding": "FULL_SHARD",
                                                              "scaling.num_workers": 2})
    gloo_pool.run(launch, reference)
    return faulted, stopped_rows, (sorted(step_losses(reference.run_dir)),
                                   final_weights(reference.run_dir, tmp / "reference-hf"))


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_hybrid_shard_ranks_resumed_from_a_replicas_part_log_their_own_metrics(tmp_path, gloo_pool4, hybrid):
    """Node 1 comes back empty: its ranks resume from their replicas' parts of step 8 on node 0 (same shards), with
    their own metrics of steps 6 to 8, not yet logged (log every 5 steps). Before, they took their replicas' metric
    rows, and those steps were logged with node 0's tokens and losses counted twice."""
    faulted, stopped_rows, _ = hybrid
    cfg = continue_copy(faulted, tmp_path, **HYBRID)
    gloo_pool4.run(launch_two_a_node, cfg)
    assert resumes(cfg) == [(FAULT_AT, "memory", 4)]
    assert {s: row for s, row in logged_rows(cfg).items() if s <= FAULT_AT} == stopped_rows
    assert len(stopped_rows) == FAULT_AT


@pytest.mark.slow  # trains for tens of seconds on 2 cores: make test-fast leaves it out
def test_a_hybrid_shard_run_that_loses_a_replica_group_goes_on_from_the_other_on_fewer_workers(
        tmp_path, gloo_pool, hybrid):
    """Node 1 does not come back: the 2 workers left (FULL_SHARD now: one node has nothing to replicate to) resume
    from node 0's group, whose shards are whole, and the run equals the run stopped at step 8 and relaunched on 2,
    bit for bit: the metrics of steps 6 to 8 held with the snapshot are logged as the 4 ranks' would have been."""
    faulted, stopped_rows, reference = hybrid
    cfg = continue_copy(faulted, tmp_path, **{**HYBRID, "parallel.sharding": "FULL_SHARD", "scaling.num_workers": 2})
    gloo_pool.run(launch_on_nodes, cfg, ["node0", "node0"])
    assert resumes(cfg) == [(FAULT_AT, "memory", 2)]
    assert {s: row for s, row in logged_rows(cfg).items() if s <= FAULT_AT} == stopped_rows
    assert_same_run(cfg, reference, tmp_path / "hf")
