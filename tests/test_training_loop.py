"""The training loop: distillation signal, exact resume, LoRA, output-directory safety, the CLI end to end."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import tiny_model
from ssmspec.errors import DataError, InputError, TokenizerMismatchError
from ssmspec.training.config import RunConfig
from ssmspec.training.loop import RUN_FILE, TrainCallbacks, prepare_out_dir, train
from test_training_common import bigram_target, char_tokenizer, one_thread, sample_token_data  # noqa: F401


def _config(tmp_path, data, mode="distill", steps=10, **optim):
    cfg = RunConfig(mode=mode, out=str(tmp_path / "out"), target="(in memory)" if mode == "distill" else None,
                    student_preset="(in memory)")
    cfg.data.spec = str(data)
    cfg.data.seq_len = 32
    cfg.data.held_out_fraction = 0.1
    cfg.optim.steps = steps
    cfg.optim.batch_size = 8
    cfg.optim.lr = 2e-2
    for k, v in optim.items():
        setattr(cfg.optim, k, v)
    cfg.eval.eval_every = 0
    cfg.eval.num_prompts = 4
    cfg.eval.prompt_len = 8
    cfg.eval.max_new_tokens = 24
    cfg.checkpoint.log_every = 1
    cfg.checkpoint.save_every = 0
    return cfg


@pytest.fixture(scope="module")
def token_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "sampled.jsonl"
    return sample_token_data(bigram_target(), path, rows=40, length=100)


# Needs ssmspec.decoding (generate + ModelDrafter) to measure acceptance by real chain decoding.
@pytest.mark.usefixtures("one_thread")
def test_distill_lowers_kl_and_raises_measured_acceptance(tmp_path, token_data):
    pytest.importorskip("ssmspec.decoding.generate", reason="acceptance needs ssmspec.decoding")
    cfg = _config(tmp_path, token_data, steps=30)
    cfg.eval.eval_every = 30
    result = train(cfg, target=bigram_target(), student=tiny_model(seed=2, std=0.02))
    first, last = result.evals[0], result.evals[-1]
    assert first["step"] == 0 and last["step"] == 30
    assert last["held_out_kl"] < 0.6 * first["held_out_kl"], (first, last)
    # Tokens per target call with a chain of 4: untrained about 1 (nothing accepted).
    assert first["mean_accepted"] < 1.3
    assert last["mean_accepted"] > first["mean_accepted"] + 0.4, (first, last)
    # The final student was written where generate / load_model read it, and reproduces the evaluation.
    from ssmspec.models.loading import load_model

    loaded = load_model(cfg.out).model
    assert loaded.config.vocab_size == 64
    log = [json.loads(line) for line in open(os.path.join(cfg.out, "log.jsonl"))]
    assert [e["event"] for e in log if e["event"] in ("start", "end")] == ["start", "end"]
    assert any(e["event"] == "eval" and "mean_accepted" in e for e in log)
    assert log[0]["scan"].startswith("ssmspec:")
    # what the run told the user is kept: a capture or compile given up is in the log, not only on a console
    assert any(e["event"] == "message" and e["text"].startswith("micro-step: eager") for e in log), log


@pytest.mark.usefixtures("one_thread")
def test_recompute_trains_the_same_steps_and_runs_each_mixer_again_in_backward(tmp_path, token_data):
    """--recompute: the same losses step for step as keeping the activations, and every Mamba
    mixer runs twice per micro-batch (its forward again in the backward pass), not once."""
    calls = {}

    def counted(student):
        for name, m in student.named_modules():
            if type(m).__name__ == "Mamba2Mixer":
                # a pre-hook: the recomputation may stop once it has what the backward needs
                m.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
        return student

    losses = {}
    for recompute in (False, True):
        calls.clear()
        cfg = _config(tmp_path / str(recompute), token_data, steps=3)
        cfg.recompute, cfg.eval.final_eval = recompute, False  # only the training steps run the mixers
        result = train(cfg, target=bigram_target(), student=counted(tiny_model(seed=2, std=0.02)))
        losses[recompute] = [m["loss"] for m in result.history]
        per_mixer = set(calls.values())
        assert per_mixer == {3 * (2 if recompute else 1)}, (recompute, calls)  # 3 steps of one micro-batch
    assert losses[True] == pytest.approx(losses[False], rel=1e-6, abs=1e-7)
    assert json.load(open(tmp_path / "True" / "out" / RUN_FILE))["config"]["recompute"] is True


class _InterruptAt(TrainCallbacks):
    def __init__(self, step, via_signal=False):
        self.step, self.via_signal = step, via_signal

    def on_step(self, m):
        if m["step"] == self.step:
            if self.via_signal:
                os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does: handled at the step boundary
            else:
                raise KeyboardInterrupt


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("via_signal", [False, True], ids=["exception", "sigint"])
def test_interrupt_then_resume_reproduces_the_uninterrupted_losses(tmp_path, token_data, via_signal):
    target = bigram_target()
    full = train(_config(tmp_path / "a", token_data, steps=10, grad_accum=2, warmup_steps=2),
                 target=target, student=tiny_model(seed=2, std=0.02))

    cfg = _config(tmp_path / "b", token_data, steps=10, grad_accum=2, warmup_steps=2)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, _InterruptAt(4, via_signal), target=target, student=tiny_model(seed=2, std=0.02))
    ck = json.load(open(os.path.join(cfg.out, "checkpoints", "latest.json")))
    assert ck["step"] == 4
    with pytest.raises(InputError, match="--resume"):  # the directory now holds a run
        train(cfg, target=target, student=tiny_model(seed=2, std=0.02))
    cfg.resume = True
    resumed = train(cfg, target=target, student=tiny_model(seed=9, std=0.02))  # weights come from the checkpoint
    want = {m["step"]: m["loss"] for m in full.history}
    got = {m["step"]: m["loss"] for m in resumed.history}
    assert sorted(got) == list(range(5, 11))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step


class _CrashAt(TrainCallbacks):
    def __init__(self, step):
        self.step = step

    def on_step(self, m):
        if m["step"] == self.step:
            raise RuntimeError("simulated crash")  # like a kill: no checkpoint is written on the way out


@pytest.mark.usefixtures("one_thread")
def test_crash_resumes_from_the_last_periodic_checkpoint(tmp_path, token_data):
    target = bigram_target()
    full = train(_config(tmp_path / "a", token_data, steps=8), target=target, student=tiny_model(seed=2, std=0.02))
    cfg = _config(tmp_path / "b", token_data, steps=8)
    cfg.checkpoint.save_every = 3
    with pytest.raises(RuntimeError, match="simulated"):
        train(cfg, _CrashAt(5), target=target, student=tiny_model(seed=2, std=0.02))
    ckdir = tmp_path / "b" / "out" / "checkpoints"
    assert sorted(p.name for p in ckdir.iterdir() if p.name.startswith("step-")) == ["step-00000003"]
    (ckdir / ".tmp-step-00000005").mkdir()  # a checkpoint cut off mid-write is never picked up
    cfg.resume = True
    resumed = train(cfg, target=target, student=tiny_model(seed=2, std=0.02))
    want = {m["step"]: m["loss"] for m in full.history}
    got = {m["step"]: m["loss"] for m in resumed.history}
    assert sorted(got) == list(range(4, 9))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step


def test_resume_refuses_overwrite_beside_it_and_fewer_steps_than_its_checkpoint(tmp_path, token_data):
    target = bigram_target()
    cfg = _config(tmp_path, token_data, steps=4)
    cfg.checkpoint.save_every = 2
    train(cfg, target=target, student=tiny_model(seed=2, std=0.02))
    checkpoints = sorted(p.name for p in (Path(cfg.out) / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert checkpoints[-1] == "step-00000004"
    both = RunConfig.from_dict(cfg.to_dict())
    both.resume = both.overwrite = True
    with pytest.raises(InputError, match="--resume .* --overwrite .* not both"):
        train(both, target=target, student=tiny_model(seed=2, std=0.02))
    shorter = RunConfig.from_dict(cfg.to_dict())
    shorter.resume, shorter.optim.steps = True, 3
    with pytest.raises(InputError, match="at step 4, past --steps 3"):
        train(shorter, target=target, student=tiny_model(seed=2, std=0.02))
    # neither touched the run
    assert sorted(p.name for p in (Path(cfg.out) / "checkpoints").iterdir() if p.name.startswith("step-")) == checkpoints


@pytest.mark.usefixtures("one_thread")
def test_lora_trains_only_adapters_and_the_merged_model_loads_in_generate(tmp_path, token_data):
    from ssmspec.models.loading import load_model

    student = tiny_model(seed=2, std=0.05)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    cfg = _config(tmp_path, token_data, mode="sft", steps=6)
    cfg.lora.enabled, cfg.lora.rank = True, 4
    result = train(cfg, student=student)
    lora_params = sum(p.numel() for n, p in student.named_parameters() if "lora_" in n)
    assert result.info["trainable_params"] == lora_params > 0
    assert result.info["lora_targets"] == ["in_proj", "out_proj"]
    merged = load_model(cfg.out).model
    after = merged.state_dict()
    assert set(after) == set(before)  # merged: no adapter tensors left
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith(("in_proj.weight", "out_proj.weight")) for k in changed), changed
    # The merged model is an ordinary LanguageModel: it drafts for a target in generate.
    from ssmspec.decoding import GenerationConfig, ModelDrafter, generate
    from ssmspec.trees import Tree

    target = tiny_model(seed=1)
    res = generate(target, [1, 2, 3], drafter=ModelDrafter(merged.eval()),
                   config=GenerationConfig(method="chain", tree=Tree.chain(3), max_new_tokens=8))
    ar = generate(target, [1, 2, 3], config=GenerationConfig(method="ar", max_new_tokens=8))
    assert res.token_ids == ar.token_ids


def test_output_directory_holding_another_run_is_refused(tmp_path):
    cfg = RunConfig(mode="sft", out=str(tmp_path / "out"), student_preset="tiny")
    cfg.data.spec = "d.jsonl"
    out = tmp_path / "out"
    assert prepare_out_dir(cfg) is None  # does not exist yet: fresh run
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="other files.*--overwrite"):
        prepare_out_dir(cfg)
    (out / RUN_FILE).write_text(json.dumps({"config": cfg.to_dict()}))
    with pytest.raises(InputError, match="already holds a training run"):
        prepare_out_dir(cfg)
    other = RunConfig.from_dict(cfg.to_dict())
    other.resume = True
    other.optim.lr = 0.5
    with pytest.raises(InputError, match="different run.*optim.lr"):
        prepare_out_dir(other)
    same = RunConfig.from_dict(cfg.to_dict())
    same.resume, same.optim.steps = True, 5000  # more steps is still the same run
    with pytest.raises(InputError, match="--resume: .* holds no checkpoint"):
        prepare_out_dir(same)  # the run stopped before its first checkpoint: nothing to resume
    other.overwrite = True
    prepare_out_dir(other)
    assert not (out / RUN_FILE).exists() and (out / "notes.txt").exists()  # only our files are removed


def test_vocab_mismatch_is_refused_before_any_work(tmp_path, token_data):
    cfg = _config(tmp_path, token_data)
    with pytest.raises(TokenizerMismatchError, match=r"64.*80|80.*64"):
        train(cfg, target=bigram_target(), student=tiny_model(vocab_size=80))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.usefixtures("one_thread")
def test_cli_distill_and_sft_on_text_chat_and_bad_records(tmp_path):
    """The commands end to end through Typer, from model directories with a tokenizer, on text and chat files."""
    from typer.testing import CliRunner

    from ssmspec.cli.app import app
    from ssmspec.models.loading import load_model, save_model

    tok = char_tokenizer()
    save_model(bigram_target(vocab_size=len(tok)), tmp_path / "target", tokenizer=tok)
    save_model(tiny_model(seed=3, vocab_size=len(tok)), tmp_path / "student", tokenizer=tok)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog.\n" * 30)
    common = ["--seq-len", "16", "--batch-size", "4", "--steps", "3", "--eval-every", "0", "--eval-num-prompts", "1",
              "--eval-max-new-tokens", "6", "--log-every", "1"]
    runner = CliRunner()
    res = runner.invoke(app, ["distill", "--target", str(tmp_path / "target"), "--student", str(tmp_path / "student"),
                              "--data", str(text), "--out", str(tmp_path / "d"), "--loss", "kl+ce", *common])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert load_model(tmp_path / "d").tokenizer is not None
    run = json.load(open(tmp_path / "d" / RUN_FILE))
    assert run["config"]["loss"]["loss"] == "kl+ce" and run["run"]["scan"].startswith("ssmspec:")

    chat = tmp_path / "chat.jsonl"
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there, friend."}]}
    chat.write_text("\n".join([json.dumps(good)] * 20 + ["{oops"] + [json.dumps(good)] * 20) + "\n")
    args = ["sft", "--student", str(tmp_path / "student"), "--data", str(chat), "--format", "chat", *common]
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "s1")])
    assert isinstance(res.exception, DataError) and "chat.jsonl:21" in str(res.exception)
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "s2"), "--on-bad-record", "skip"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert "chat.jsonl:21" in res.output
    print(res.output)
    log = [json.loads(line) for line in open(tmp_path / "s2" / "log.jsonl")]
    assert [e["count"] for e in log if e["event"] == "bad_records"] == [1]
    # A different student vocabulary is refused with both sizes named, before any output is written.
    save_model(tiny_model(seed=3, vocab_size=70), tmp_path / "wide")
    res = runner.invoke(app, ["distill", "--target", str(tmp_path / "target"), "--student", str(tmp_path / "wide"),
                              "--data", str(text), "--out", str(tmp_path / "w"), *common])
    assert isinstance(res.exception, TokenizerMismatchError) and "51" in str(res.exception) and "70" in str(res.exception)


@pytest.mark.slow
@pytest.mark.requires_cuda
def test_accelerate_launch_two_gpus_trains_with_near_double_throughput(tmp_path):
    """Not run on CPU machines: needs 2 GPUs (device kind nvidia-h200-x2) and `accelerate launch`."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from pathlib import Path

    from ssmspec.models.loading import save_model
    from ssmspec.models.presets import build_model

    target = build_model("tiny", vocab_size=256, seed=1, std=0.3)
    save_model(target, tmp_path / "target")
    data = sample_token_data(target, tmp_path / "data.jsonl", rows=256, length=513)
    exe = str(Path(sys.executable).parent / "ssmspec")
    tps = {}
    for n in (1, 2):
        out = tmp_path / f"out{n}"
        multi = ["--multi_gpu"] if n > 1 else []
        cmd = ["accelerate", "launch", *multi, "--num_processes", str(n), "--mixed_precision", "bf16", exe, "distill",
               "--target", str(tmp_path / "target"), "--student-preset", "drafter-2l", "--data", str(data),
               "--out", str(out), "--steps", "60", "--seq-len", "512", "--batch-size", "128", "--eval-every", "0",
               "--log-every", "20", "--dtype", "bf16"]
        subprocess.run(cmd, check=True, env={**os.environ, "NCCL_NVLS_ENABLE": "0"})
        steps = [json.loads(line) for line in open(out / "log.jsonl") if '"event": "step"' in line]
        tps[n] = steps[-1]["tokens_per_s"]
        assert steps[-1]["loss"] < steps[0]["loss"]
    print(f"distill tokens/s: 1 GPU {tps[1]:.0f}, 2 GPUs {tps[2]:.0f}, ratio {tps[2] / tps[1]:.2f}")
    assert tps[2] > 1.6 * tps[1], tps


@pytest.mark.slow
def test_a_signal_to_one_of_two_processes_stops_both_at_one_checkpoint(tmp_path, token_data):
    """SIGTERM reaches rank 1 only: both ranks stop after the same log step and the run checkpoints
    it (alone, rank 1 left while rank 0 waited for it in the next all-reduce)."""
    import time

    from ssmspec.models.loading import save_model
    from ssmspec.training.loop import latest_checkpoint

    save_model(bigram_target(), tmp_path / "target")
    exe = str(Path(sys.executable).parent / "ssmspec")
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", exe, "distill", "--target",
           str(tmp_path / "target"), "--student-preset", "tiny", "--data", str(token_data), "--steps", "100000",
           "--seq-len", "32", "--batch-size", "2", "--eval-every", "0", "--log-every", "2", "--save-every", "0",
           "--dtype", "fp32", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: the finally stops the workers too
    try:
        deadline = time.time() + 120

        def steps_logged():
            log = out / "log.jsonl"
            return sum('"event": "step"' in line for line in open(log)) if log.exists() else 0

        while steps_logged() < 2:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            assert time.time() < deadline, "no step logged in 120 s"
            time.sleep(0.5)
        ranks = subprocess.run(["pgrep", "-f", "-P", str(proc.pid), "ssmspec"], capture_output=True, text=True).stdout.split()
        workers = [int(p) for p in ranks]
        assert len(workers) == 2, ranks
        rank1 = next(p for p in workers if "LOCAL_RANK=1" in open(f"/proc/{p}/environ").read().replace("\0", " "))
        os.kill(rank1, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    events = [json.loads(line) for line in open(out / "log.jsonl")]
    stopped = [e for e in events if e["event"] == "interrupted"]
    assert len(stopped) == 1 and stopped[0]["step"] % 2 == 0, (stopped, err[-2000:])
    assert latest_checkpoint(out).name == f"step-{stopped[0]['step']:08d}"


@pytest.mark.slow
def test_two_cpu_processes_reproduce_the_single_process_run(tmp_path, token_data):
    """DDP over 2 CPU processes (torchrun, gloo), batch 2 each, trains exactly the 1-process batch-4 run."""
    from pathlib import Path

    from ssmspec.models.loading import save_model

    save_model(bigram_target(), tmp_path / "target")
    exe = str(Path(sys.executable).parent / "ssmspec")
    common = ["distill", "--target", str(tmp_path / "target"), "--student-preset", "tiny", "--data", str(token_data),
              "--steps", "6", "--seq-len", "32", "--eval-every", "0", "--log-every", "1", "--eval-num-prompts", "1",
              "--eval-max-new-tokens", "4", "--dtype", "fp32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([exe, *common, "--batch-size", "4", "--out", str(tmp_path / "one")], check=True, env=env)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", exe, *common,
                    "--batch-size", "2", "--out", str(tmp_path / "two")], check=True, env=env)
    losses = {}
    for name in ("one", "two"):
        log = [json.loads(line) for line in open(tmp_path / name / "log.jsonl")]
        losses[name] = [e["loss"] for e in log if e["event"] == "step"]
        assert [e["world_size"] for e in log if e["event"] == "start"] == [1 if name == "one" else 2]
    assert losses["one"] == pytest.approx(losses["two"], rel=1e-5)
