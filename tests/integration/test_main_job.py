"""The main job's failure paths (examples/train_hybrid.py, the harness that runs
examples/train.py under torchrun), on a tiny model (a KDA layer with a dense MLP, an MLA layer
with a MoE block of 8 experts split over both ranks) and 2 CPU ranks; also the shortest run
(the MoE dispatch and combine in the table and the trace, the balanced router bias equal to the
serial model's), ``--packed`` against each document alone, train.py's ``--resume``, and the
shortest ``--model qwen3-next`` run (a Gated DeltaNet layer with a dense MLP, a gated attention
layer with 1 key/value head over the 2 ranks and a MoE block with the gated shared expert)
agreeing with its serial reference. ``--pp`` (pipeline_model): its options checked in the
launcher by hp-models' own rules, the stage meter and the pipeline report, without ranks.

Each test starts the job as a user would (the harness launches torchrun itself), with a tag of
its own in the environment that every process of the job inherits, and afterwards scans /proc
for that tag: nothing of the job may be left, whatever way it ended (Ctrl-C, SIGTERM,
``--job-timeout``, a failed rank, a NaN loss, the launcher SIGKILLed).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_hybrid.py"
sys.path.insert(0, str(ROOT / "examples"))

RANKS = 2
TINY = ["--mesh", "2,1", "--seq", "16", "--hidden", "16", "--ffn", "32", "--moe-ffn", "16",
        "--layers", "kda,mla", "--heads", "2", "--kda-head-dim", "8", "--vocab", "16",
        "--rank-timeout", "30"]  # fmt: skip
# TINY's sizes, Qwen3-Next's mixers: Gated DeltaNet (1 key head, 2 value heads) + a dense MLP,
# gated attention (2 heads, 1 key/value head: fewer than the ranks) + a MoE block
QWEN3_NEXT = ["--model", "qwen3-next", *TINY]
QWEN3_NEXT[QWEN3_NEXT.index("kda,mla")] = "gdn,attn"
FOREVER = ["--steps", "100000"]  # runs until it is stopped
START_S = 90  # start-up of torchrun + ranks on a loaded 2-core machine
GONE_S = 20  # the bound: nothing of the job left after this

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/environ").exists(), reason="scans /proc for the job's processes"
)


class MainJob:
    """The launcher in a session of its own (so a process-group SIGINT is a terminal Ctrl-C),
    output to a file, ``HP_TEST_TAG`` in its environment."""

    def __init__(self, tmp_path: Path, *extra: str, base: list[str] = TINY) -> None:
        self.tag = f"HP_TEST_TAG={uuid.uuid4().hex}"
        self.out = tmp_path / "out"
        self.log = tmp_path / "job.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
        env["HP_TEST_TAG"] = self.tag.split("=", 1)[1]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), *base, "--out", str(self.out), *extra],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def processes(self) -> set[int]:
        """Live processes carrying this job's tag (zombies have no environment)."""
        found = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if self.tag.encode() in env:
                found.add(int(entry.name))
        return found

    def wait_for_ranks(self) -> None:
        """Until every rank has started (its pid file) and the whole job is visible."""
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            ready = len(list(self.out.glob(".rank*.pid"))) == RANKS
            if ready and len(self.processes()) >= RANKS + 2:  # launcher, torchrun, ranks
                time.sleep(1.0)  # into the training loop
                return
            assert self.proc.poll() is None, f"job ended early:\n{self.output()}"
            time.sleep(0.2)
        raise AssertionError(f"ranks did not start within {START_S}s:\n{self.output()}")

    def finish(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        return self.log.read_text()

    def assert_nothing_left(self) -> None:
        deadline = time.monotonic() + GONE_S
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = self.processes()
        assert not left, f"processes of the job still running after {GONE_S}s: {sorted(left)}"

    def kill_all(self) -> None:
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def job_factory(tmp_path):
    jobs: list[MainJob] = []

    def start(*extra: str, base: list[str] = TINY) -> MainJob:
        jobs.append(MainJob(tmp_path, *extra, base=base))
        return jobs[-1]

    yield start
    for job in jobs:  # whatever a failing test left, the next one does not see it
        job.kill_all()


def _last_line(output: str) -> str:
    return [ln for ln in output.splitlines() if ln.startswith("train_hybrid:")][-1]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_main_job_interrupt_ends_torchrun_and_every_rank(job_factory, how):
    job = job_factory(*FOREVER)
    job.wait_for_ranks()
    if how == "ctrl-c":  # what a terminal does: SIGINT to the foreground process group
        os.killpg(job.proc.pid, signal.SIGINT)
    else:
        job.proc.send_signal(signal.SIGTERM)
    rc = job.finish(timeout=GONE_S)
    name = "SIGINT" if how == "ctrl-c" else "SIGTERM"
    assert rc == 128 + getattr(signal, name), job.output()
    assert f"train_hybrid: FAILED: interrupted by {name}" in _last_line(job.output())
    job.assert_nothing_left()


@pytest.mark.timeout(180)
def test_main_job_timeout_ends_torchrun_and_every_rank(job_factory):
    job = job_factory(*FOREVER, "--job-timeout", "8")
    rc = job.finish(timeout=8 + START_S)
    assert rc == 1, job.output()
    assert "exceeded --job-timeout 8s" in _last_line(job.output())
    job.assert_nothing_left()


@pytest.mark.timeout(180)
def test_main_job_launcher_killed_takes_the_job_with_it(job_factory):
    """SIGKILL to the launcher (no cleanup runs): torchrun and the ranks die with it."""
    job = job_factory(*FOREVER)
    job.wait_for_ranks()
    job.proc.kill()
    job.finish(timeout=10)
    job.assert_nothing_left()


@pytest.mark.timeout(180)
def test_main_job_failed_rank_is_named_and_nothing_is_left(job_factory):
    job = job_factory("--steps", "8", "--fail-rank", "1", "--fail-step", "2")
    rc = job.finish(timeout=START_S + 30)
    assert rc == 1, job.output()
    assert _last_line(job.output()) == (
        "train_hybrid: FAILED: rank 1: injected failure at step 2"
    ), job.output()
    job.assert_nothing_left()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nan_rank", [-1, 1])
def test_main_job_stops_at_a_nan_loss_naming_step_and_rank(job_factory, nan_rank):
    """--nan-step puts a NaN into the embedding output of every rank (-1) or of one rank at a
    step; it reaches every rank through the layers' exchanges and the loss sum, yet every rank
    stops at that step (none hangs) and the reason names the rank where it first appeared."""
    job = job_factory("--steps", "8", "--nan-step", "3", "--nan-rank", str(nan_rank))
    rc = job.finish(timeout=START_S + 30)
    assert rc == 1, job.output()
    first = 0 if nan_rank == -1 else nan_rank
    count = RANKS if nan_rank == -1 else 1
    assert _last_line(job.output()) == (
        f"train_hybrid: FAILED: non-finite loss at step 3: first non-finite output embedding on "
        f"rank {first} (there on {count} of {RANKS} ranks; loss nan)"
    ), job.output()
    assert not (job.out / "parallel.json").exists()
    job.assert_nothing_left()


@pytest.mark.timeout(180)
def test_main_job_tiny_run_agrees_and_draws_the_trace(job_factory):
    """The shortest run (2 steps: the traced step follows the step count) writes the harness's
    outputs and train.py's own (loss plot, losses, the final sharded checkpoint)."""
    job = job_factory("--steps", "2")
    rc = job.finish(timeout=START_S + 60)
    assert rc == 0, job.output()
    assert _last_line(job.output()) == "train_hybrid: OK: parallel and serial loss curves agree"
    assert ("training KimiLinearForCausalLM: 2 layers (kda, mla; MLPs dense, moe: 8 experts, "
            "top-2, ep=2)") in job.output()  # fmt: skip
    for name in ("loss_curves.png", "trace_step.json", "trace_step.png", "parallel.json",
                 "loss.png", "losses.json", "ckpt/step-2/.metadata"):  # fmt: skip
        assert (job.out / name).stat().st_size > 0, name
    assert len(json.loads((job.out / "losses.json").read_text())["losses"]) == 2
    assert (job.out / "trace_step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the comm lane (tid 1) holds every layer's collectives: MLA's, KDA's and MC2's
    trace = json.loads((job.out / "trace_step.json").read_text())
    comm = {e["name"] for e in trace["traceEvents"] if e.get("tid") == 1 and e.get("ph") == "X"}
    assert any(n.startswith("a2a:") for n in comm), comm  # MLA's all-to-alls
    assert comm & {"send:halo", "recv:halo", "send:state", "recv:state"}, comm  # KDA's
    assert comm & {"all_gather:x", "reduce_scatter:partial"}, comm  # MC2's
    assert {"all_reduce:loss_tokens", "all_reduce:loss"} <= comm, comm  # hp-models' loss
    # the MoE layer's (hp-moe): routing counts, dispatch and combine, forward and backward
    assert "moe:counts" in comm, comm
    for name in ("moe:dispatch", "moe:combine"):  # numbered by chunk: moe:dispatch0, …
        assert any(n.startswith(name) and not n.endswith(":grad") for n in comm), (name, comm)
        assert any(n.startswith(name) and n.endswith(":grad") for n in comm), (name, comm)
    assert "all_reduce:expert_load" in comm, comm  # balance_experts, after the step
    # the table: the MoE layer's row, then a line per hp-moe collective with its bytes
    lines = job.output().splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("1:moe "))
    assert "hp-moe: 4 of 8 experts a rank, ep=2" in lines[at], lines[at]
    under = {ln.split()[0]: ln for ln in lines[at + 1 : at + 4]}
    assert sorted(under) == ["moe:combine", "moe:counts", "moe:dispatch"], lines[at : at + 4]
    assert all(ln.startswith("  ") and ("KiB" in ln or " B " in ln) for ln in under.values())
    record = json.loads((job.out / "parallel.json").read_text())
    rows = {r["layer"]: r for r in record["layers"]}
    moe = rows["1:moe"]["collectives"]
    for name in ("moe:dispatch", "moe:dispatch:grad", "moe:combine", "moe:combine:grad"):
        assert all(n > 0 for n in moe[name]), (name, moe)
    assert not rows["0:mlp"]["collectives"].keys() & set(moe), rows["0:mlp"]  # MC2's only
    # the router's loads: every (token, expert) assignment of the whole batch (2 x 16 tokens,
    # top-2), each step; its bias, balanced after every step, is the serial model's
    assert [sum(s["model.layers.1.mlp.gate"]) for s in record["router_loads"]] == [64, 64]
    assert record["router_bias_same_on_every_rank"]
    assert any(v != 0 for v in record["router_bias"][-1]["model.layers.1.mlp.gate"])
    assert ("router bias: balance_experts after every step (rate 0.001)" in job.output()
            and "equal to the serial model's (the rule on the same loads) after every step"
            in job.output()), job.output()  # fmt: skip
    # FSDP2's (the default gradient reduction on torch 2.13), timed from its named ranges
    reduction = json.loads((job.out / "parallel.json").read_text())["grad_reduction"]
    assert reduction in ("fsdp", "allreduce"), reduction
    if reduction == "fsdp":
        assert any(n.startswith("fsdp all_gather ") for n in comm), comm
        assert any(n.startswith("fsdp reduce_scatter ") for n in comm), comm
    job.assert_nothing_left()


@pytest.mark.timeout(180)
def test_main_job_qwen3_next_agrees_with_its_serial_reference(job_factory):
    """--model qwen3-next, the shortest run: every layer kind of the family (Gated DeltaNet's
    state passing, the gated attention's all-to-alls with fewer key/value heads than ranks, the
    dense MLP, the MoE block with its gated shared expert) parallelised, and the loss curve
    equal to the stock serial model's; its routers (no bias) route the batch alike."""
    job = job_factory("--steps", "2", base=QWEN3_NEXT)
    rc = job.finish(timeout=START_S + 60)
    output = job.output()
    assert rc == 0, output
    assert _last_line(output) == "train_hybrid: OK: parallel and serial loss curves agree"
    assert ("training Qwen3NextForCausalLM: 2 layers (gdn, attn; gated attention 2 heads, 1 "
            "key/value head over 2 ranks; MLPs dense, moe: 8 experts, top-2, gated shared "
            "expert, ep=2)") in output  # fmt: skip
    lines = output.splitlines()
    row = {ln.split()[0]: ln for ln in lines if ln[:2] in ("0:", "1:")}
    assert "Gated DeltaNet state passing" in row["0:gdn"], row
    assert "Ulysses gated GQA over cp·tp" in row["1:attn"], row
    assert "hp-moe: 4 of 8 experts a rank, ep=2" in row["1:moe"], row
    record = json.loads((job.out / "parallel.json").read_text())
    assert (record["model"], record["family"]) == ("qwen3-next", "qwen3-next")
    assert len(record["losses"]) == 2 and all(math.isfinite(v) for v in record["losses"])
    # every (token, expert) assignment of the whole batch (2 x 16 tokens, top-2), each step
    assert [sum(s["model.layers.1.mlp.gate"]) for s in record["router_loads"]] == [64, 64]
    assert record["router_bias"] == [{}, {}]  # no e_score_correction_bias: nothing balanced
    assert "router bias: none" in output and "picks the parallel model's experts at" in output
    trace = json.loads((job.out / "trace_step.json").read_text())
    comm = {e["name"] for e in trace["traceEvents"] if e.get("tid") == 1 and e.get("ph") == "X"}
    assert comm & {"send:halo", "recv:halo", "send:state", "recv:state"}, comm  # GDN's
    assert any(n.startswith("a2a:") for n in comm), comm  # the gated attention's
    assert any(n.startswith("moe:dispatch") for n in comm), comm
    assert "all_reduce:expert_load" not in comm, comm  # balance_experts not called
    assert (job.out / "loss_curves.png").stat().st_size > 0
    job.assert_nothing_left()


@pytest.mark.timeout(180)
def test_main_job_packed_documents_agree_with_each_document_alone(job_factory):
    """--packed: each row holds documents of random lengths (positions restarting at 0, label
    -100 at each start); the harness's serial reference runs the stock model on each document
    alone and takes the token mean over every labelled token. The curves agree (a tight tol),
    and the first loss is the documents-alone loss, not the stock model's on the whole row
    (which lets the documents see each other)."""
    import _data
    import train
    import train_hybrid

    job = job_factory("--steps", "2", "--packed", "--tol", "1e-4")
    rc = job.finish(timeout=START_S + 60)
    assert rc == 0, job.output()
    assert _last_line(job.output()) == "train_hybrid: OK: parallel and serial loss curves agree"
    assert "1 x 16 tokens per step, packed documents" in job.output()
    # every token of the packed row routed alike (one-token documents included)
    assert "picks the parallel model's experts at 2 of 2 steps" in job.output(), job.output()
    first = json.loads((job.out / "losses.json").read_text())["losses"][0]
    _, _, t = train_hybrid.parse_args([*TINY, "--packed"])  # the job's train.py options
    assert t.dtype == "float64"  # the harness's default on CPU
    docs = _data.documents(t, 0)
    assert len(docs) == 1 and len(docs[0]) > 3, docs  # one row, several documents
    model, batch = train.build_model(t), _data.batch(t, 0)
    alone = train_hybrid.packed_loss(model, batch["input_ids"], docs).item()
    whole = model(**batch, use_cache=False).loss.item()
    assert first == pytest.approx(alone, rel=1e-6)
    assert abs(first - whole) > 1e-4 * whole, (first, whole)  # 100x the agreement above
    job.assert_nothing_left()


@pytest.mark.timeout(300)
def test_main_job_resume_continues_the_uninterrupted_run(tmp_path):
    """train.py (no harness): 4 steps with a DCP checkpoint at step 2; a run given only that
    checkpoint and --resume trains steps 3-4 with the uninterrupted run's losses (model and
    AdamW state restored; the data stream depends on the step alone)."""
    import shutil

    def train_py(out: Path, *extra: str) -> dict:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={RANKS}", str(ROOT / "examples" / "train.py"),
               *TINY[: TINY.index("--rank-timeout")], "--timeout", "60", "--out", str(out),
               *extra]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=START_S + 60)
        assert run.returncode == 0, run.stdout + run.stderr
        return json.loads((out / "losses.json").read_text())

    whole = train_py(tmp_path / "whole", "--steps", "4", "--save-every", "2")
    assert whole["first_step"] == 0 and len(whole["losses"]) == 4
    shutil.copytree(tmp_path / "whole" / "ckpt" / "step-2", tmp_path / "resumed/ckpt/step-2")
    resumed = train_py(tmp_path / "resumed", "--steps", "4", "--save-every", "2", "--resume")
    assert resumed["first_step"] == 2 and len(resumed["losses"]) == 2
    assert resumed["losses"] == pytest.approx(whole["losses"][2:], rel=1e-6, abs=0)
    assert resumed["losses"] != pytest.approx(whole["losses"][:2], rel=1e-3)  # not a restart


def _tiny_folder(path: Path) -> Path:
    """A hub-layout folder of a tiny stock Kimi-Linear the shape of TINY's: KDA + dense MLP, MLA
    + a MoE block of 4 experts (stock ``save_pretrained``)."""
    from hyper_parallel.models.testing import tiny_model

    model = tiny_model("kimi", seed=0, num_hidden_layers=2, mlp_layer_types=["dense", "sparse"],
                       layer_types=["linear_attention", "full_attention"])  # fmt: skip
    model.save_pretrained(path)
    return path


@pytest.mark.timeout(180)
def test_main_job_trains_a_hugging_face_folder(job_factory, tmp_path, capsys):
    """--model PATH: the ranks load the folder with from_pretrained (each reading its own
    slices), the serial reference is the stock AutoModelForCausalLM.from_pretrained(PATH); the
    curves agree and the report names the folder, its family and each rank's bytes read. Then
    the report of the same run under --no-serial (in this process: no second run) says that
    nothing was compared."""
    import train_hybrid

    folder = _tiny_folder(tmp_path / "tiny-kimi")
    base = ["--model", str(folder), "--mesh", "2,1", "--seq", "16", "--rank-timeout", "30"]
    job = job_factory("--steps", "2", "--tol", "1e-4", base=base)
    rc = job.finish(timeout=START_S + 60)
    output = job.output()
    assert rc == 0, output
    assert _last_line(output) == "train_hybrid: OK: parallel and serial loss curves agree"
    assert ("training KimiLinearForCausalLM: 2 layers (kda, mla; MLPs dense, moe: 4 experts, "
            "top-2, ep=2)") in output  # fmt: skip
    assert f"loaded {folder} (kimi-linear, from_pretrained): " in output, output
    load = json.loads((job.out / "parallel.json").read_text())["load"]
    assert (load["path"], load["family"]) == (str(folder), "kimi-linear")
    read = load["bytes_read_per_rank"]
    assert len(read) == RANKS and all(0 < n < load["folder_bytes"] for n in read), load
    for rank, n in enumerate(read):  # each rank's own line in the table
        assert f"  rank {rank}: read " in output and f"({n:,} bytes, " in output, output
    job.assert_nothing_left()

    h, _, t = train_hybrid.parse_args([*base, "--steps", "2", "--out", str(job.out),
                                       "--no-serial"])  # fmt: skip
    assert h.no_serial and t.folder == str(folder)
    record = json.loads((job.out / "parallel.json").read_text())
    capsys.readouterr()
    assert train_hybrid.summarize(h, t, record, None) == ""  # nothing compared: nothing fails
    said = capsys.readouterr().out
    assert "serial comparison SKIPPED (--no-serial)" in said, said
    assert "median step: parallel " in said and ", no serial run" in said, said
    assert f"loaded {folder} (kimi-linear, from_pretrained)" in said


def test_folder_options_come_from_its_config(tmp_path, capsys):
    import train

    folder = _tiny_folder(tmp_path / "tiny-kimi")
    t = train.parse_args(["--model", str(folder), "--mesh", "2,1"])
    assert (t.folder, t.mixers, t.mlps, t.experts, t.top_k, t.ep) == (
        str(folder), ["kda", "mla"], ["dense", "moe"], 4, 2, 2
    )  # fmt: skip
    assert t.vocab == 48  # the data's tokens: at most the folder's vocabulary
    assert train.parse_args([]).folder is None  # the tiny random model by default
    for bad in (["--hidden", "16"], ["--experts", "0"], ["--layers", "kda"]):
        with pytest.raises(SystemExit):
            train.parse_args(["--model", str(folder), "--mesh", "2,1", *bad])
        assert "the folder's config.json sizes this one" in capsys.readouterr().err, bad
    with pytest.raises(SystemExit):
        train.parse_args(["--model", str(tmp_path / "missing")])
    assert "or a folder with a config.json" in capsys.readouterr().err


def test_qwen3_next_options_follow_the_family(tmp_path, capsys):
    """--model qwen3-next: 3 Gated DeltaNet layers to 1 gated attention by default, key/value
    heads fewer than the ranks, mlp_only_layers from --dense-layers, the gated shared expert as
    wide as an expert; a qwen3_next folder's layout from its config.json; errors name what is
    allowed."""
    import train

    from hyper_parallel.models.testing import tiny_model

    t = train.parse_args(["--model", "qwen3-next"])
    assert (t.family, t.mixers, t.mlps, t.kv_heads, t.ep) == (
        "qwen3-next", ["gdn", "gdn", "gdn", "attn"], ["dense", "moe", "moe", "moe"], 2, 4
    )  # fmt: skip
    assert train.describe_mlps(t) == (
        "MLPs dense, moe, moe, moe: 8 experts, top-2, gated shared expert, ep=4"
    )
    c = train.build_model(train.parse_args(["--model", "qwen3-next", "--dense-layers", "2"])).config
    assert type(c).__name__ == "Qwen3NextConfig"
    assert c.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (c.mlp_only_layers, c.num_key_value_heads, c.num_attention_heads) == ([0, 1], 2, 4)
    assert (c.shared_expert_intermediate_size, c.moe_intermediate_size, c.num_experts) == (
        32, 32, 8
    )  # fmt: skip
    assert (c.linear_num_key_heads, c.linear_num_value_heads) == (2, 4)
    folder = tmp_path / "tiny-qwen3-next"
    tiny_model("qwen3-next", seed=0).save_pretrained(folder)  # gdn, attn, gdn, attn
    t = train.parse_args(["--model", str(folder), "--mesh", "2,1"])
    assert (t.family, t.mixers, t.mlps, t.experts, t.top_k) == (
        "qwen3-next", ["gdn", "attn", "gdn", "attn"], ["dense", "moe", "moe", "moe"], 4, 2
    )  # fmt: skip
    assert train.model_name(t) == "tiny-qwen3-next (qwen3-next)"
    for bad, said in (
        (["--model", "qwen3-next", "--layers", "gdn,mla"],
         "--layers for --model qwen3-next takes gdn / attn per layer, got 'gdn,mla'"),
        (["--layers", "gdn,attn"], "--layers for --model kimi-linear takes kda / mla per layer"),
        (["--model", "qwen3"], "--model takes kimi-linear / deepseek-v3 / qwen3-next or a folder"),
        (["--kv-heads", "2"], "--kv-heads sizes --model qwen3-next's gated attention"),
        (["--model", "qwen3-next", "--kv-heads", "3"], "--kv-heads a divisor of it"),
    ):  # fmt: skip
        with pytest.raises(SystemExit):
            train.parse_args(bad)
        assert said in capsys.readouterr().err, bad


def test_curve_comparison_counts_nan_as_disagreement():
    import _report

    assert _report.compare_curves([1.0, 2.0], [1.0, 2.0], 1e-3) == (0.0, "")
    rel, reason = _report.compare_curves([1.0, math.nan], [1.0, 2.0], 1e-3)
    assert rel == math.inf and reason == "parallel loss is nan at step 1"
    rel, reason = _report.compare_curves([1.0, 2.0], [math.inf, 2.0], 1e-3)
    assert rel == math.inf and reason == "serial loss is inf at step 0"
    rel, reason = _report.compare_curves([1.0, 2.1], [1.0, 2.0], 1e-3)
    assert reason.startswith("loss curves disagree: max relative difference 5.00e-02 > tol")
    assert _report.max_rel_diff([0.0, math.nan], [0.0, 1.0])[0] == math.inf
    assert "differ in length" in _report.compare_curves([1.0], [1.0, 2.0], 1e-3)[1]


def test_slower_reason_names_cores_and_gloo():
    import _report

    line = _report.slower_reason("cpu", _report.usable_cores() + 2, 2.0, 1.0)
    assert line.startswith("parallel step is 2.0x the serial one because ")
    assert f"{_report.usable_cores() + 2} ranks share {_report.usable_cores()} CPU core" in line
    assert "gloo" in line
    assert _report.slower_reason("cpu", 4, 1.0, 2.0) == ""
    assert "gloo" not in _report.slower_reason("cuda", 4, 2.0, 1.0)


def test_moe_options_default_to_every_rank_and_refuse_an_uneven_split(capsys):
    import train

    t = train.parse_args(["--mesh", "2,2"])
    assert (t.mlps, t.experts, t.ep) == (["dense", "moe", "moe", "moe"], 8, 4)
    assert train.describe_mlps(t) == "MLPs dense, moe, moe, moe: 8 experts, top-2, ep=4"
    t = train.parse_args(["--mesh", "2,2", "--ep", "2", "--dense-layers", "0"])
    assert (t.mlps, t.ep) == (["moe"] * 4, 2)
    t = train.parse_args(["--mesh", "2,2", "--experts", "0"])  # dense MLPs only: no ep
    assert (t.mlps, t.ep, train.describe_mlps(t)) == (["dense"] * 4, 1, "dense MLPs")
    for bad in (["--ep", "3"], ["--experts", "6"], ["--top-k", "9"], ["--balance-rate", "-1"]):
        with pytest.raises(SystemExit):
            train.parse_args(["--mesh", "2,2", *bad])
        assert "error:" in capsys.readouterr().err, bad


def test_harness_weights_are_float64_on_cpu_unless_given_or_under_autocast():
    import train_hybrid

    dtype = lambda *argv: train_hybrid.parse_args(list(argv))[2].dtype  # noqa: E731
    assert dtype() == "float64"  # MoE routing alike in both runs (see the module docstring)
    assert dtype("--dtype", "float32") == dtype("--dtype=float32") == "float32"
    assert dtype("--autocast", "bf16") == dtype("--device", "cuda") == "float32"


def test_moe_collectives_are_named_without_their_chunk_and_summed_with_their_grad():
    import _report
    import train_hybrid

    family = train_hybrid.collective_family
    assert family("moe:dispatch1:grad") == "moe:dispatch:grad"
    assert family("moe:combine0") == "moe:combine"
    assert family("moe:counts") == "moe:counts" and family("a2a:q") == "a2a:q"
    row = {"collectives": {"moe:combine:grad": [4, 5], "moe:combine": [1, 2],
                           "moe:counts": [8, 8], "moe:dispatch": [3, 3]}}  # fmt: skip
    assert _report.moe_collectives(row) == [
        ("moe:counts", [8, 8]), ("moe:dispatch", [3, 3]), ("moe:combine", [5, 7])
    ]  # fmt: skip
    assert train_hybrid.bias_difference({"a": [0.0, 1e-3]}, {"a": [0.0, -1e-3]}) == 2e-3
    assert train_hybrid.bias_difference({"a": [0.0]}, {"b": [0.0]}) == math.inf


def test_trace_lanes_nest_compute_and_keep_collectives_apart():
    from _trace_plot import nesting_depth, spans_by_rank

    x = lambda name, ts, dur, tid, pid=0: {"ph": "X", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                           "pid": pid, "tid": tid}  # fmt: skip
    trace = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {}},
        x("layer 0:mla (forward)", 0, 100, 0), x("q_proj (forward)", 10, 20, 0),
        x("wait a2a:q", 40, 5, 0), x("a2a:q", 12, 33, 1), x("layer 1:mlp (forward)", 100, 50, 0),
        x("layer 0:mla (forward)", 0, 90, 0, pid=1),
    ]}  # fmt: skip
    lanes = spans_by_rank(trace)
    assert sorted(lanes) == [0, 1] and sorted(lanes[0]) == [0, 1]
    assert [e["name"] for e in lanes[0][1]] == ["a2a:q"]
    assert nesting_depth(lanes[0][0]) == [0, 1, 1, 0]


# ---- --pp: the pipeline's options, its stage meter and its report (no ranks: seconds) --------
# The job itself under --pp (4 ranks, about 1.5 min on 2 cores) is run by hand, see the README:
# python3 tools/dev.py train --pp 2 --schedule 1F1B --microbatches 4 [--model deepseek-v3]


def test_pipeline_options_fail_with_the_library_errors_before_any_rank(capsys):
    """--pp: a (pp, cp, tp) mesh on 4 ranks by default, one micro-batch row a micro-batch, ep
    over a stage's ranks; a schedule, stage count or micro-batch count the library refuses
    fails in the launcher with hp-models' own ValueError; without --pp nothing changes."""
    import train
    import train_hybrid

    from hyper_parallel.models.pipeline.schedules import check_schedule
    from hyper_parallel.models.pipeline.split import balanced_split, check_layer_split

    t = train.parse_args([])  # the default job: no pipeline
    assert (t.pp, t.mesh, t.dims, t.dim_names, t.ranks, t.batch) == (
        1, (2, 2), (2, 2), ("cp", "tp"), 4, 2
    )  # fmt: skip
    t = train.parse_args(["--pp", "2", "--schedule", "1F1B", "--microbatches", "4"])
    assert (t.dims, t.dim_names, t.ranks, t.batch, t.ep, t.stages_per_rank) == (
        (2, 2, 1), ("pp", "cp", "tp"), 4, 4, 2, 1
    )  # fmt: skip
    t = train.parse_args(["--pp", "2", "--mesh", "2,1,1", "--schedule", "Interleaved1F1B"])
    assert (t.dims, t.dim_names, t.stages_per_rank, t.microbatches, t.batch) == (
        (2, 2, 1, 1), ("pp", "dp", "cp", "tp"), 2, 4, 8
    )  # fmt: skip
    assert train.parse_args(["--pp", "2", "--layer-split", "1,3"]).layer_split == [1, 3]
    assert train_hybrid.parse_args(["--pp", "2"])[2].ranks == 4  # torchrun's ranks

    def library(fn, *args):  # the message hp-models raises for the same options
        with pytest.raises(ValueError) as exc:
            fn(*args)
        return str(exc.value)

    for argv, said in (
        (["--microbatches", "1"], library(check_schedule, "1F1B", 2, 1, 1)),
        (["--stages-per-rank", "2"], library(check_schedule, "1F1B", 2, 2, 2)),
        (["--schedule", "Interleaved1F1B", "--microbatches", "5"],
         library(check_schedule, "Interleaved1F1B", 2, 2, 5)),
        (["--schedule", "ZBVZeroBubble", "--microbatches", "2"],
         library(check_schedule, "ZBVZeroBubble", 2, 2, 2)),
        (["--schedule", "Interleaved1F1B", "--stages-per-rank", "4"],
         library(balanced_split, [1.0] * 4, 8)),
        (["--layer-split", "1,2"], library(check_layer_split, [1, 2], 4, 2)),
        (["--batch", "3"], "--batch 3 does not divide into microbatches·dp = 2·1 = 2"),
    ):  # fmt: skip
        with pytest.raises(SystemExit):
            train_hybrid.parse_args(["--pp", "2", *argv])
        assert said in capsys.readouterr().err, (argv, said)
    with pytest.raises(SystemExit):
        train.parse_args(["--microbatches", "4"])
    assert "give --pp (>= 2)" in capsys.readouterr().err


# python3 tools/dev.py train --overlap forward_backward --microbatches 2 [--model deepseek-v3]


def test_forward_backward_overlap_option_runs_micro_batches_at_pp_1(capsys):
    """--overlap forward_backward: pipeline_model over the pp = 1 mesh with 2 micro-batches by
    default (the batch: microbatches·dp rows); refused with --pp >= 2 and with fewer than 2
    micro-batches; --microbatches at --pp 1 only with it; on / off pass through. The trace's
    micro-batch lane: the recorded segments, on the recorder's clock."""
    import train
    import train_hybrid
    from _pipeline_meter import micro_batch_lane

    from hyper_parallel.dtensor.recorder import Event

    t = train.parse_args(["--overlap", "forward_backward"])
    assert (t.pp, t.dims, t.dim_names, t.microbatches, t.batch, t.ranks) == (
        1, (2, 2), ("cp", "tp"), 2, 2, 4
    )  # fmt: skip
    t = train.parse_args(["--overlap", "forward_backward", "--mesh", "2,1,1", "--microbatches",
                          "3"])  # fmt: skip
    assert (t.dims, t.dim_names, t.microbatches, t.batch) == ((2, 1, 1), ("dp", "cp", "tp"), 3, 6)
    assert train.parse_args([]).overlap == "on"
    assert train.parse_args(["--overlap", "off"]).microbatches is None
    assert train_hybrid.parse_args(["--overlap", "forward_backward"])[2].ranks == 4
    for argv, said in (
        (["--pp", "2"], "--overlap forward_backward interleaves the micro-batches of one stage"),
        (["--microbatches", "1"], "it needs --microbatches 2 or more, got 1"),
        (["--batch", "3"], "--batch 3 does not divide into microbatches·dp = 2·1 = 2"),
        (["--schedule", "GPipe"], "give --pp (>= 2)"),
    ):
        with pytest.raises(SystemExit):
            train.parse_args(["--overlap", "forward_backward", *argv])
        assert said in capsys.readouterr().err, (argv, said)
    with pytest.raises(SystemExit):
        train.parse_args(["--overlap", "off", "--microbatches", "2"])
    assert "with --overlap forward_backward" in capsys.readouterr().err

    def ev(kind, name, t_ns):
        return Event(kind, name, name.split()[0], t_ns)

    trace = {"traceEvents": []}
    events = [ev("segment_begin", "forward mb0", 1000), ev("segment_end", "forward mb0", 3000),
              ev("segment_begin", "forward mb1", 3000), ev("segment_end", "forward mb1", 4000),
              ev("segment_begin", "backward mb0", 4500),
              ev("segment_end", "backward mb0", 6000)]  # fmt: skip
    assert micro_batch_lane(trace, events, pid=1) == 3
    spans = [(e["name"], e["ts"], e["dur"], e["tid"]) for e in trace["traceEvents"]
             if e["ph"] == "X"]  # fmt: skip
    assert spans == [("forward mb0", 0.0, 2.0, 2), ("forward mb1", 2.0, 1.0, 2),
                     ("backward mb0", 3.5, 1.5, 2)]  # fmt: skip
    empty: dict = {"traceEvents": []}
    assert micro_batch_lane(empty, events[:1], 0) == 0 and not empty["traceEvents"]


def test_pipeline_stage_meter_times_and_traces_each_micro_batch():
    """StageMeter wraps torch's stages as pm.step builds them: each stage's forward and
    backward summed over the micro-batches, a recorder span per micro-batch, the step's wall
    time; the trace labels and the report name each stage's layers and ranks."""
    from _pipeline_meter import StageMeter, bubble
    from _report import pipeline_lines
    from _trace_plot import pipeline_label
    from train import layer_span
    from train_hybrid import same_bias, summed_loads

    from hyper_parallel.dtensor.recorder import record_events

    class Stage:  # torch's PipelineStage, as far as the meter sees it
        def __init__(self, index):
            self.stage_index = index

        def forward_one_chunk(self, chunk, *args):
            time.sleep(0.002)

        def backward_one_chunk(self, chunk, **kwargs):
            time.sleep(0.004)

    class Runner:
        def __init__(self):
            self._stages = [Stage(0), Stage(2)]

        def step(self):
            for s in self._stages:
                for k in range(2):
                    s.forward_one_chunk(k, ())
            for s in self._stages:
                for k in range(2):
                    s.backward_one_chunk(k, loss=None)

    class Pipelined:  # PipelinedModel: _build makes the runner in the first step
        _runner = None

        def _build(self):
            return Runner()

        def step(self):
            if self._runner is None:
                self._runner = self._build()
            self._runner.step()

    pm = Pipelined()
    meter = StageMeter(pm)
    with record_events() as rec:
        meter.recorder = rec
        pm.step()
    times = meter.snapshot()
    assert sorted(times) == ["0", "2"]
    assert all(f >= 0.004 and b >= 0.008 for f, b in times.values()), times
    assert meter.step_s >= sum(sum(v) for v in times.values())
    spans = [e["name"] for e in rec.to_chrome_trace()["traceEvents"] if e.get("ph") == "X"]
    assert spans[:2] == ["stage 0 mb 0 (forward)", "stage 0 mb 1 (forward)"], spans
    assert "stage 2 mb 1 (backward)" in spans and len(spans) == 8
    assert pipeline_label("stage 2 mb 1 (backward)", True) == "s2 B1"
    assert pipeline_label("stage 0 mb 3 (forward)", False) == "F3"
    assert bubble("1F1B", 2, 4, 1) == pytest.approx(0.2)
    assert bubble("ZBVZeroBubble", 2, 4, 2) is None
    # a pipeline's routers: each on its stage's ranks, loads summed over them
    assert summed_loads([{"a": [1, 2]}, {"a": [3, 4]}, {"b": [5]}]) == {"a": [4, 6], "b": [5]}
    ranks = [{"router_bias": [{"a": [0.1]}]}, {"router_bias": [{"b": [0.2]}]}]
    assert same_bias(ranks) and not same_bias([*ranks, {"router_bias": [{"a": [0.3]}]}])
    record = {"pipeline": {
        "pp": 2, "schedule": "1F1B", "microbatches": 4, "stages_per_rank": 1,
        "timed_steps": [1, 3], "bubble": 0.2,
        "stages": [{"stage": 0, "layers": [0, 2], "ranks": [0, 1], "forward_s": 0.1,
                    "backward_s": 0.2},
                   {"stage": 1, "layers": [2, 4], "ranks": [2, 3], "forward_s": 0.3,
                    "backward_s": 0.4}],
        "ranks": [{"rank": r, "stages": [r // 2], "busy_s": 0.3, "step_s": 0.5, "idle": 0.4}
                  for r in range(4)],
    }}  # fmt: skip
    lines = pipeline_lines(record, layer_span, ["kda", "mla", "kda", "mla"]).splitlines()
    assert lines[1].startswith("pipeline: pp=2, schedule 1F1B, 4 micro-batches a step")
    assert lines[3].split() == ["0", "0-1", "(kda,", "mla)", "0,1", "100.0", "200.0"]
    assert lines[5] == (
        "rank 0 (stage 0): busy 300.0 ms of 500.0 ms in PipelinedModel.step, idle 0.40"
    )
    assert lines[-1].endswith("1F1B's bubble with equal stages (p-1)/(m+p-1) = 0.20")
