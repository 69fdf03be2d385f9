"""Train the embedded function-calling model (Qwen3 architecture) on the synthetic BFCL-style task.

Resumable: a training checkpoint (weights, optimizer, step) is written every ``--save-every`` steps
to ``--ckpt-dir``; rerunning the same command continues from it. Each evaluation exports a Hugging
Face checkpoint (config.json, model.safetensors, tokenizer files, chat template, generation
config) to ``--out``. Batches are a deterministic function of (seed, step), so a resumed run sees
the same data it would have seen.

    python -m models.train --out models/structkv-fc-6m            # the shipped model
    python -m models.train --micro --steps 20 --out /tmp/m --ckpt-dir /tmp/ck   # smoke run

Loss is on the assistant answer only. ``long_context`` examples join the mix from
``--long-start`` on (a curriculum: they cost about ten short examples each on a CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from models import chat, synth
from models.checker import check

DEFAULT_CKPT_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "structkv-train"
SHORT_MIX = {"simple": 2, "multiple": 3, "parallel": 2, "parallel_multiple": 3, "irrelevance": 1.5}


def model_config(tokenizer, micro: bool = False):
    from transformers import Qwen3Config
    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16) if micro else \
        dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32)
    return Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=4096, rope_theta=100000.0,
                       tie_word_embeddings=True, rms_norm_eps=1e-6, torch_dtype="float32",
                       bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids(chat.IM_END),
                       pad_token_id=tokenizer.convert_tokens_to_ids(chat.EOT), **size)


def build_tokenizer(vocab_size: int = 4096):
    from models.tokenizer import train_tokenizer
    texts = []
    for seed, rename in [(101, 0.0), (102, 0.6)]:
        gen = synth.Generator("train", seed=seed, rename_prob=rename)
        for category in synth.CATEGORIES:
            for ex in gen.examples(category, 300 if category == "long_context" else 1500):
                texts += [json.dumps(ex.tools), ex.messages[-1]["content"], chat.render_answer(ex.answer)]
    return train_tokenizer(texts, vocab_size)


def encode(tokenizer, ex: synth.Example) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 on the prompt) for one example."""
    prompt = tokenizer.apply_chat_template(ex.messages, tools=ex.tools, add_generation_prompt=True,
                                           tokenize=False)
    answer = chat.render_answer(ex.answer, synth.NO_CALL_ANSWER) + chat.IM_END + "\n"
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    a_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    return p_ids + a_ids, [-100] * len(p_ids) + a_ids


def mix_at(step: int, args) -> dict[str, float]:
    """Sampling weight of each category at ``step``: ``SHORT_MIX``, long_context from
    ``args.long_start``, and the ``--mix`` overrides from ``args.mix_from``."""
    mix = dict(SHORT_MIX)
    if step >= args.long_start:
        mix["long_context"] = args.long_weight
    if step >= args.mix_from:
        mix.update(args.mix)
    return mix


def batches_for_step(tokenizer, gen: synth.Generator, step: int, args) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches of one optimizer step: ``args.batch_size`` examples, grouped by length so
    that each micro-batch holds at most ``args.max_batch_tokens`` padded tokens."""
    rng = random.Random(f"{args.seed}/step/{step}")
    cats, weights = zip(*mix_at(step, args).items())
    encoded = []
    for i in range(args.batch_size):
        ex = gen.example(rng.choices(cats, weights)[0], step * args.batch_size + i)
        ids, labels = encode(tokenizer, ex)
        encoded.append((ids[: args.max_len], labels[: args.max_len]))
    encoded.sort(key=lambda e: len(e[0]))
    groups, current = [], []
    for item in encoded:
        if current and len(item[0]) * (len(current) + 1) > args.max_batch_tokens:
            groups.append(current)
            current = []
        current.append(item)
    groups.append(current)
    out = []
    for group in groups:
        width = max(len(ids) for ids, _ in group)
        ids = torch.full((len(group), width), tokenizer.pad_token_id)
        labels = torch.full((len(group), width), -100)
        for r, (i, l) in enumerate(group):
            ids[r, : len(i)], labels[r, : len(l)] = torch.tensor(i), torch.tensor(l)
        out.append((ids, labels))
    return out


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def greedy_answer(model, tokenizer, ex: synth.Example, max_new_tokens: int = 200) -> str:
    prompt = tokenizer.apply_chat_template(ex.messages, tools=ex.tools, add_generation_prompt=True,
                                           tokenize=False)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def exact_match(model, tokenizer, examples: list[synth.Example]) -> dict[str, float]:
    """Share of examples whose greedy answer passes the BFCL AST checker, per category."""
    model.eval()
    per_cat: dict[str, list[bool]] = {}
    for ex in examples:
        try:
            calls, _ = chat.parse_tool_calls(greedy_answer(model, tokenizer, ex))
            ok = check(ex.tools, calls, ex.ground_truth, ex.category).valid
        except ValueError:
            ok = False
        per_cat.setdefault(ex.category, []).append(ok)
    model.train()
    return {c: sum(v) / len(v) for c, v in per_cat.items()}


def export(model, tokenizer, out: Path, step: int) -> None:
    from transformers import GenerationConfig
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=[model.config.eos_token_id, model.config.pad_token_id],
                     pad_token_id=model.config.pad_token_id, do_sample=False).save_pretrained(out)
    (out / "trainer_state.json").write_text(json.dumps({"global_step": step}) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="HF checkpoint folder to export to")
    ap.add_argument("--ckpt-dir", type=Path, default=DEFAULT_CKPT_DIR, help="resumable state")
    ap.add_argument("--steps", type=int, default=12000, help="total optimizer steps (cosine schedule)")
    ap.add_argument("--batch-size", type=int, default=16, help="examples per optimizer step")
    ap.add_argument("--max-batch-tokens", type=int, default=8192, help="padded tokens per micro-batch")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--long-start", type=int, default=3000, help="step at which long_context joins")
    ap.add_argument("--long-weight", type=float, default=1.5)
    ap.add_argument("--rename-prob", type=float, default=0.5)
    ap.add_argument("--mix", action="append", default=[], metavar="CATEGORY=WEIGHT",
                    help="override a category's sampling weight (repeatable), from step --mix-from on")
    ap.add_argument("--mix-from", type=int, default=0, help="first step of the --mix weights")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--eval-examples", type=int, default=6, help="dev examples per category")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-from", type=Path, help="with no resumable state: start from this exported "
                    "checkpoint's weights, at its trainer_state.json step (fresh optimizer)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: all cores)")
    ap.add_argument("--fp32", action="store_true", help="disable bf16 autocast")
    ap.add_argument("--micro", action="store_true", help="tiny config for smoke tests")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    mix = {}
    for item in args.mix:
        cat, _, weight = item.partition("=")
        if cat not in synth.CATEGORIES:
            ap.error(f"--mix {item!r}: unknown category {cat!r}; choose from {', '.join(synth.CATEGORIES)}")
        try:
            mix[cat] = float(weight)
        except ValueError:
            ap.error(f"--mix {item!r}: the weight must be a number")
        if mix[cat] < 0:
            ap.error(f"--mix {item!r}: the weight must be >= 0")
    args.mix = mix
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    log = (args.ckpt_dir / "log.jsonl").open("a")

    from transformers import AutoTokenizer, Qwen3ForCausalLM
    tok_dir = args.ckpt_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        if args.init_from:  # keep the checkpoint's own tokenizer
            AutoTokenizer.from_pretrained(args.init_from).save_pretrained(tok_dir)
        else:
            build_tokenizer(256 + 512 if args.micro else 4096).save_pretrained(tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    model = Qwen3ForCausalLM(model_config(tokenizer, args.micro)).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    state_path, step = args.ckpt_dir / "state.pt", 0
    if state_path.exists():
        state = torch.load(state_path, map_location=args.device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        print(f"resumed from {state_path} at step {step}", file=sys.stderr)
    elif args.init_from:
        from safetensors.torch import load_file
        weights = load_file(args.init_from / "model.safetensors")
        model.load_state_dict(weights, strict=False)  # lm_head is tied to the embeddings
        model.tie_weights()
        step = json.loads((args.init_from / "trainer_state.json").read_text())["global_step"]
        print(f"initialized from {args.init_from} at step {step} (fresh optimizer)", file=sys.stderr)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{num_params / 1e6:.2f}M parameters, training to step {args.steps}", file=sys.stderr)

    gen = synth.Generator("train", seed=args.seed, rename_prob=args.rename_prob)
    dev = synth.Generator("dev", seed=args.seed)
    model.train()
    bar = tqdm(total=args.steps, initial=step, desc="train", dynamic_ncols=True)
    while step < args.steps:
        t0 = time.time()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        micro = batches_for_step(tokenizer, gen, step, args)
        num_answer = sum(int((labels != -100).sum()) for _, labels in micro)
        total_loss, num_tokens = 0.0, 0
        for ids, labels in micro:
            ids, labels = ids.to(args.device), labels.to(args.device)
            # bf16 autocast: about 2x the CPU throughput of fp32 here (avx512_bf16); fp32 master weights.
            with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=not args.fp32):
                logits = model(input_ids=ids).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     labels[:, 1:].reshape(-1), reduction="sum",
                                                     ignore_index=-100)
            (loss / num_answer).backward()
            total_loss += loss.item()
            num_tokens += ids.numel()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        record = {"step": step, "loss": total_loss / max(1, num_answer), "lr": lr_at(step - 1, args),
                  "grad_norm": grad_norm, "tokens": num_tokens, "s": time.time() - t0}
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{num_tokens / record['s']:.0f}")
        if step % args.eval_every == 0 or step == args.steps:
            cats = [c for c in synth.CATEGORIES if c != "long_context" or step >= args.long_start]
            examples = [dev.example(c, i) for c in cats for i in range(args.eval_examples)]
            record["dev_exact_match"] = exact_match(model, tokenizer, examples)
            export(model, tokenizer, args.out, step)
            tqdm.write(f"step {step}: dev exact match {json.dumps(record['dev_exact_match'])}")
        log.write(json.dumps(record) + "\n")
        log.flush()
        if step % args.save_every == 0 or step == args.steps:
            tmp = state_path.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, state_path)
    bar.close()
    export(model, tokenizer, args.out, step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
