#!/usr/bin/env python3
"""Trains one member of the bundled tiny Llama family (eval/tinyfamily/README.md).

From scratch (cross-entropy on the training split) or, with --teacher, distilled from a larger
member: loss = --kl_weight * KL(teacher || student) on the teacher's next-byte distribution
+ --ce_weight * cross-entropy on the text. Training is bounded by wall-clock time (--minutes);
the learning rate follows a warmup + cosine schedule over that time, so a run on a loaded machine
ends on time with a fully decayed schedule. Writes into --out: model.safetensors + config.json
(loadable by transformers' LlamaForCausalLM), train_log.csv (loss curve), summary.json
(tokens, steps, held-out bits per byte), and a checkpoint every --checkpoint_minutes.
--also trains further students on the same batches, so one teacher forward pass serves several
students (distillation on 2 cores is dominated by the teacher otherwise).

    nice -n 5 python3 eval/tinyfamily/train.py --out eval/tinyfamily/models/L --name kvt-tiny-L \\
        --layers 6 --hidden 128 --heads 4 --kv_heads 2 --head_dim 32 --ffn 384 --minutes 45
"""

import argparse
import csv
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

# Run as a script (README.md here), outside Bazel: its own directory is on the path already;
# tools/ (dump_kv.py, which model.py imports) is added here, once.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "tools"))
import corpus  # noqa: E402
import model as tiny  # noqa: E402


def byte_stream(docs):
    """Documents as UTF-8 bytes joined by EOS (0), as dump_kv.py joins them."""
    parts = []
    for d in docs:
        parts.append(np.frombuffer(d["text"].encode("utf-8"), dtype=np.uint8))
        parts.append(np.zeros(1, dtype=np.uint8))
    return np.concatenate(parts).astype(np.int64)


def copy_row(rng, data, length, random_share=0.0, dense=False):
    """A training row where context far back matters: a passage (32-160 bytes) of the training
    text, unrelated text (16-320 bytes), the same passage again, then ordinary text to the end.
    The second copy is only predictable by looking back (induction), which plain prose rarely
    rewards; eval/retention.copy_windows measures the same skill on held-out text. dense: such
    units one after another to the end of the row (more copy targets per row). Returns the row
    and the mask of its targets inside second copies (the training log's copy figure)."""
    lead = int(rng.integers(0, 65))
    t = int(rng.integers(0, len(data) - length - 1))
    parts, copied = [data[t:t + lead]], np.zeros(length - 1, dtype=bool)
    at = lead
    while at < length:
        n, gap = int(rng.integers(32, 161)), int(rng.integers(16, 321))
        s, f = (int(rng.integers(0, len(data) - length - 1)) for _ in range(2))
        passage = data[s:s + n]
        if rng.random() < random_share:
            # Random printable bytes: nothing but the earlier copy predicts them, so the
            # gradient asks for copying alone (natural passages are half predictable from
            # local statistics).
            passage = rng.integers(32, 127, n).astype(np.int64)
        parts += [passage, data[f:f + gap], passage]
        # Targets only an earlier copy predicts: the second copy after its first byte.
        second = at + n + gap
        copied[min(second, length - 1):min(second + n - 1, length - 1)] = True
        at = second + n
        if not dense:
            break
    row = np.concatenate(parts + [data[t + lead:t + lead + length]])[:length]
    return row, copied


def repeat_row(rng, length, max_period, data=None, prose_share=0.0, small_alphabet_share=0.0):
    """A row of random printable bytes with period P (uniform in 16..max_period): a random
    block repeated to the end of the row, so every byte after the first period is predictable
    only by finding its earlier copy P bytes back (and nothing else in the row predicts
    anything). The cheapest dense signal for induction: most targets are copy targets, at every
    distance up to max_period. prose_share: the share of rows whose block is training text
    instead; random bytes are told apart by one or two earlier bytes, prose only by a longer
    match, and a model taught on random blocks alone copies them but keeps trusting its prose
    prior on prose. small_alphabet_share: the share of the random blocks drawn from 2-8
    printable bytes, where, as in prose, only a match of several earlier bytes finds the copy.
    Returns the row and the mask of its copy targets (those after the first byte of the second
    period, as in copy_row)."""
    period = int(rng.integers(16, max_period + 1))
    if data is not None and rng.random() < prose_share:
        s = int(rng.integers(0, len(data) - period))
        block = data[s:s + period]
    elif rng.random() < small_alphabet_share:
        alphabet = rng.choice(np.arange(32, 127), int(rng.integers(2, 9)), replace=False)
        block = rng.choice(alphabet, period).astype(np.int64)
    else:
        block = rng.integers(32, 127, period).astype(np.int64)
    row = np.tile(block, length // period + 1)[:length]
    copied = np.zeros(length - 1, dtype=bool)
    copied[period:] = True
    return row, copied


def lookup_row(rng, data, length):
    """A training row with key -> value lookups: "abc=12345;" pairs (random 3-letter key, random
    5-digit value) planted at random places in training text, then the same pairs again in
    another order, so the values are only predictable from the context
    (eval/retention.lookup_windows). Returns the row and its mask of copy targets (none)."""
    pairs = int(rng.integers(2, 13))
    keys = ["".join(chr(97 + int(c)) for c in rng.integers(0, 26, 3)) for _ in range(pairs)]
    items = [np.frombuffer(f"{k}={int(v):05d};".encode(), dtype=np.uint8).astype(np.int64)
             for k, v in zip(keys, rng.integers(0, 100000, pairs))]
    body = int(rng.integers(pairs, length - 20 * pairs))  # text around the planted pairs
    f = int(rng.integers(0, len(data) - length - 1))
    filler = data[f:f + body]
    places = sorted(int(x) for x in rng.choice(len(filler) + 1, pairs, replace=False))
    parts = []
    for i, (a, b) in enumerate(zip([0] + places, places + [len(filler)])):
        parts.append(filler[a:b])
        if i < pairs:
            parts.append(items[i])
    parts += [items[i] for i in rng.permutation(pairs)]
    row = np.concatenate(parts)
    row = np.concatenate([row, data[f + body:f + body + length]])[:length]
    return row, np.zeros(length - 1, dtype=bool)


def training_batch(rng, data, batch, seq, copy_fraction, lookup_fraction,
                   random_copy_share=0.0, dense_copies=False, repeat_fraction=0.0,
                   max_period=400, prose_repeat_share=0.0, small_alphabet_share=0.0):
    """(x, y, copied): batch rows of seq + 1 bytes as inputs and targets, plain text or, with
    the given probabilities, a copy row, a lookup row or a repeat row (the mix that teaches the
    family to use context far back); copied marks the targets inside second copies."""
    if copy_fraction == 0 and lookup_fraction == 0 and repeat_fraction == 0:
        # The draws of the runs before the mix.
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        return (torch.from_numpy(np.stack([data[s:s + seq] for s in starts])),
                torch.from_numpy(np.stack([data[s + 1:s + seq + 1] for s in starts])),
                torch.zeros(batch, seq, dtype=torch.bool))
    rows, masks = [], []
    for u in rng.random(batch):
        if u < copy_fraction:
            row, copied = copy_row(rng, data, seq + 1, random_copy_share, dense_copies)
        elif u < copy_fraction + lookup_fraction:
            row, copied = lookup_row(rng, data, seq + 1)
        elif u < copy_fraction + lookup_fraction + repeat_fraction:
            row, copied = repeat_row(rng, seq + 1, max_period, data, prose_repeat_share,
                                     small_alphabet_share)
        else:
            s = int(rng.integers(0, len(data) - seq - 1))
            row, copied = data[s:s + seq + 1], np.zeros(seq, dtype=bool)
        rows.append(row)
        masks.append(copied)
    rows = torch.from_numpy(np.stack(rows))
    return rows[:, :-1], rows[:, 1:], torch.from_numpy(np.stack(masks))


def heldout_bpb(model, data, seq, max_windows=None):
    """Bits per byte over consecutive non-overlapping windows (each a fresh forward from 0)."""
    model.eval()
    device = next(model.parameters()).device
    n = (len(data) - 1) // seq
    if max_windows:
        n = min(n, max_windows)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, n, 8):
            idx = range(i, min(n, i + 8))
            x = torch.stack([torch.from_numpy(data[j * seq:j * seq + seq]) for j in idx])
            y = torch.stack([torch.from_numpy(data[j * seq + 1:j * seq + seq + 1]) for j in idx])
            logits = model(x.to(device))
            total += F.cross_entropy(logits.reshape(-1, tiny.VOCAB), y.to(device).reshape(-1),
                                     reduction="sum").item()
            count += y.numel()
    model.train()
    return total / count / math.log(2)


class Student:
    """One model being trained: its weights, optimizer, log and output directory."""

    def __init__(self, out, name, layers, hidden, heads, kv_heads, head_dim, ffn, seed, lr,
                 init="", device="cpu"):
        self.out, self.name = out, name
        self.model = tiny.Llama(tiny.hf_config(layers, hidden, heads, kv_heads, head_dim, ffn,
                                               name))
        self.model.init_weights(seed)
        # Continued training: start from a trained member's weights (same shape) and keep its
        # summary, so the new summary can report the cumulative bytes honestly.
        self.previous = None
        if init:
            previous = tiny.load(init)
            if previous.config != self.model.config:
                raise SystemExit(f"--init {init}: its config.json does not match {name}'s shape")
            self.model.load_state_dict(previous.state_dict())
            # A --checkpoint_every directory (step-N) has no summary: then only its weights.
            if os.path.exists(os.path.join(init, "summary.json")):
                with open(os.path.join(init, "summary.json")) as f:
                    self.previous = json.load(f)
        self.model.to(device)
        self.params = sum(q.numel() for q in self.model.parameters())
        decay = [q for q in self.model.parameters() if q.dim() >= 2]
        no_decay = [q for q in self.model.parameters() if q.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=lr, betas=(0.9, 0.95))
        os.makedirs(out, exist_ok=True)
        self.log = open(os.path.join(out, "train_log.csv"), "w", newline="")
        self.writer = csv.writer(self.log)
        self.writer.writerow(["step", "seconds", "tokens", "lr", "loss", "ce_bits_per_byte",
                              "heldout_bits_per_byte", "copy_bits_per_byte"])


def parse_student(spec, seed, lr, device="cpu"):
    """OUT:NAME:LAYERS:HIDDEN:HEADS:KV_HEADS:HEAD_DIM:FFN[:INIT_DIR]"""
    parts = spec.split(":")
    if len(parts) not in (8, 9):
        raise SystemExit(f"--also: expected OUT:NAME:LAYERS:HIDDEN:HEADS:KV_HEADS:HEAD_DIM:FFN"
                         f"[:INIT_DIR], got {spec!r}")
    return Student(parts[0], parts[1], *map(int, parts[2:8]), seed=seed, lr=lr,
                   init=parts[8] if len(parts) == 9 else "", device=device)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True, help="model name (config _name_or_path)")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--kv_heads", type=int, required=True)
    p.add_argument("--head_dim", type=int, required=True)
    p.add_argument("--ffn", type=int, required=True)
    p.add_argument("--also", action="append", default=[],
                   help="another student OUT:NAME:LAYERS:HIDDEN:HEADS:KV_HEADS:HEAD_DIM:FFN "
                        "trained on the same batches (one teacher forward pass serves all)")
    p.add_argument("--teacher", default="", help="directory of the member to distill from")
    p.add_argument("--kl_weight", type=float, default=1.0)
    p.add_argument("--ce_weight", type=float, default=None,
                   help="default 1 from scratch, 0.1 when distilling")
    p.add_argument("--minutes", type=float, required=True, help="wall-clock training budget")
    p.add_argument("--max_steps", type=int, default=0, help="stop after N steps (smoke tests)")
    p.add_argument("--steps", type=int, default=0,
                   help="train for N steps, the schedule running over steps; --minutes is then "
                        "only a safety cap (a loaded machine cannot shorten the training)")
    p.add_argument("--init", default="",
                   help="continue from this member's weights (same shape); summary.json then "
                        "reports the bytes of both runs")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup_steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu",
                   help="torch device to train on (cpu, cuda); weights are written as float32 "
                        "from the CPU either way")
    p.add_argument("--checkpoint_minutes", type=float, default=5)
    p.add_argument("--eval_every", type=int, default=200, help="steps between held-out checks")
    p.add_argument("--corpus_root", default=corpus.SOURCES)
    p.add_argument("--copy_fraction", type=float, default=0.0,
                   help="share of rows with a passage repeated after a gap (copy_row)")
    p.add_argument("--random_copy_share", type=float, default=0.0,
                   help="share of copy rows whose passage is random printable bytes")
    p.add_argument("--dense_copies", action="store_true",
                   help="copy rows hold passage/gap/passage units to their end, not one")
    p.add_argument("--lookup_fraction", type=float, default=0.0,
                   help="share of rows with planted key=value lookups (lookup_row)")
    p.add_argument("--repeat_fraction", type=float, default=0.0,
                   help="share of rows of random printable bytes repeated with a period "
                        "(repeat_row): the dense, copy-only signal of an induction curriculum")
    p.add_argument("--max_period", type=int, default=400,
                   help="longest period of a repeat row (periods are uniform from 16)")
    p.add_argument("--prose_repeat_share", type=float, default=0.0,
                   help="share of repeat rows whose repeated block is training text, not "
                        "random bytes (copying prose needs a longer match than random bytes)")
    p.add_argument("--small_alphabet_share", type=float, default=0.0,
                   help="share of the random repeat blocks drawn from 2-8 printable bytes")
    p.add_argument("--checkpoint_every", type=int, default=0,
                   help="also save the weights every N steps into OUT/step-N (to measure "
                        "eval/copy_gain.py along the run: --family OUT --members step-N)")
    args = p.parse_args()
    ce_weight = args.ce_weight if args.ce_weight is not None else (0.1 if args.teacher else 1.0)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    splits = corpus.splits(args.corpus_root)
    train = byte_stream(splits["train"])
    heldout = byte_stream(splits["heldout"])

    students = [Student(args.out, args.name, args.layers, args.hidden, args.heads, args.kv_heads,
                        args.head_dim, args.ffn, args.seed, args.lr, init=args.init,
                        device=args.device)]
    students += [parse_student(spec, args.seed, args.lr, args.device) for spec in args.also]
    teacher = None
    if args.teacher:
        teacher = tiny.load(args.teacher).eval().to(args.device)
        for q in teacher.parameters():
            q.requires_grad_(False)
    for st in students:
        print(f"{st.name}: {st.params} parameters, train {len(train)} bytes, heldout "
              f"{len(heldout)} bytes, teacher={args.teacher or '-'}", flush=True)

    budget = args.minutes * 60
    start = time.time()
    last_checkpoint = start
    step = tokens = 0
    while True:
        elapsed = time.time() - start
        if elapsed >= budget or (args.max_steps and step >= args.max_steps) or \
                (args.steps and step >= args.steps):
            break
        frac = step / args.steps if args.steps else elapsed / budget
        lr = args.lr * min(1.0, (step + 1) / args.warmup_steps) * \
            (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        x, y, copied = training_batch(rng, train, args.batch, args.seq, args.copy_fraction,
                                      args.lookup_fraction, args.random_copy_share,
                                      args.dense_copies, args.repeat_fraction, args.max_period,
                                      args.prose_repeat_share, args.small_alphabet_share)
        x, y, copied = x.to(args.device), y.to(args.device), copied.to(args.device)
        t_logp = None
        if teacher is not None:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(x).reshape(-1, tiny.VOCAB), dim=-1)
        step += 1
        tokens += x.numel()
        for st in students:
            for g in st.opt.param_groups:
                g["lr"] = lr
            logits = st.model(x).reshape(-1, tiny.VOCAB)
            per_byte = F.cross_entropy(logits, y.reshape(-1), reduction="none")
            ce = per_byte.mean()
            mask = copied.reshape(-1)
            copy_bpb = (f"{per_byte[mask].mean().item() / math.log(2):.4f}" if mask.any()
                        else "")
            loss = ce_weight * ce
            if t_logp is not None:
                kl = F.kl_div(F.log_softmax(logits, dim=-1), t_logp, log_target=True,
                              reduction="batchmean")
                loss = loss + args.kl_weight * kl
            st.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(st.model.parameters(), 1.0)
            st.opt.step()
            held = ""
            if step % args.eval_every == 0:
                held = f"{heldout_bpb(st.model, heldout, args.seq, max_windows=64):.4f}"
            if step % 10 == 0 or held:
                print(f"{st.name} step {step} {time.time() - start:.0f}s ce_bpb "
                      f"{ce.item() / math.log(2):.3f} copy_bpb {copy_bpb or '-'}", flush=True)
                st.writer.writerow([step, f"{time.time() - start:.1f}", tokens, f"{lr:.6f}",
                                    f"{loss.item():.4f}", f"{ce.item() / math.log(2):.4f}",
                                    held, copy_bpb])
                st.log.flush()
            if held:
                print(f"{st.name} step {step} {time.time() - start:.0f}s tokens {tokens} ce_bpb "
                      f"{ce.item() / math.log(2):.3f} heldout_bpb {held}", flush=True)
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            for st in students:
                tiny.save(st.model, os.path.join(st.out, f"step-{step}"))
        if time.time() - last_checkpoint > args.checkpoint_minutes * 60:
            for st in students:
                tiny.save(st.model, os.path.join(st.out, "checkpoint"))
            last_checkpoint = time.time()
    train_seconds = time.time() - start
    for st in students:
        tiny.save(st.model, st.out)
        bpb = heldout_bpb(st.model, heldout, args.seq)
        summary = {"name": st.name, "parameters": st.params, "steps": step, "tokens": tokens,
                   "train_seconds": round(train_seconds), "batch": args.batch, "seq": args.seq,
                   "lr": args.lr, "teacher": args.teacher, "kl_weight": args.kl_weight,
                   "ce_weight": ce_weight, "copy_fraction": args.copy_fraction,
                   "random_copy_share": args.random_copy_share,
                   "dense_copies": args.dense_copies,
                   "lookup_fraction": args.lookup_fraction,
                   "repeat_fraction": args.repeat_fraction, "max_period": args.max_period,
                   "prose_repeat_share": args.prose_repeat_share,
                   "small_alphabet_share": args.small_alphabet_share,
                   "heldout_bits_per_byte": round(bpb, 4),
                   "heldout_bytes": len(heldout), "corpus": corpus.PACKAGE,
                   "trained_with": [o.name for o in students if o is not st],
                   "command": " ".join(sys.argv)}
        if st.previous is not None:
            summary["continued_from"] = st.previous
            summary["tokens_total"] = tokens + st.previous.get("tokens_total",
                                                               st.previous["tokens"])
        with open(os.path.join(st.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        st.writer.writerow([step, f"{train_seconds:.1f}", tokens, "", "", "", f"{bpb:.4f}"])
        st.log.close()
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
