"""Train the tiny-llama sample: byte-level BPE tokenizer + a small Llama-style causal LM on CPU.

    python samples/tiny-llama/make_corpus.py          # data/ (deterministic)
    python samples/tiny-llama/train.py                # -> samples/tiny-llama/model/, train_log.json
    python samples/tiny-llama/train.py --quick --out /tmp/tl   # a few steps, smoke test

Everything is seeded and runs in fp32 on the CPU with a fixed thread count; the checkpoint is
saved in bf16 (what fp8export converts). The log records the validation loss of the fp32 and of
the saved bf16 model next to a unigram baseline (validation tokens scored under training-split
token frequencies), both in nats per token over the same targets.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning: on a shared 2-core machine spinning threads
# made each training step ~10x slower (35 s vs 3 s measured). Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HERE = Path(__file__).resolve().parent
PAD, BOS, EOS = "<pad>", "<s>", "</s>"

# Model shape: GQA (4 query heads, 2 KV heads) so fused q/k/v projections have different
# shapes, intermediate 688 (a multiple of 16, as FP8 GEMMs want), an untied lm_head so it is
# a separate tensor that convert must leave in bf16.
MODEL = dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=688, max_position_embeddings=256, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")


def build_tokenizer(train_file: Path, vocab_size: int):
    """Byte-level BPE trained on the training split, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=[PAD, BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(train_file)], trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama: encoding a text prepends <s>, so a one-line sample is scored from its first word.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, bos_id)]),
    ])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, model_max_length=MODEL["max_position_embeddings"])
    return fast


def portable_tokenizer_files(out: Path, tokenizer) -> None:
    """Make the saved tokenizer load with transformers 4.x as well as 5.x.

    transformers 5 names its backend class ``TokenizersBackend`` and no longer writes
    special_tokens_map.json; 4.x knows neither. ``PreTrainedTokenizerFast`` loads in both.
    """
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def read_lines(path: Path, limit: int | None = None) -> list[str]:
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    return lines[:limit] if limit else lines


def encode_docs(tokenizer, lines: list[str]) -> list[list[int]]:
    """<s> story </s> per line (the tokenizer adds <s>)."""
    enc = tokenizer(lines, add_special_tokens=True)["input_ids"]
    return [ids + [tokenizer.eos_token_id] for ids in enc]


def pack(docs: list[list[int]], block: int):
    """Concatenate documents and cut into equal blocks (no padding, every token trains)."""
    import torch

    flat = [t for d in docs for t in d]
    n = len(flat) // block
    return torch.tensor(flat[: n * block], dtype=torch.long).view(n, block)


def unigram_ce(train_docs, val_docs) -> float:
    """Cross-entropy (nats/token) of validation targets under add-one training frequencies.

    Targets are what the LM is scored on: every token after the leading <s>.
    """
    counts = Counter(t for d in train_docs for t in d[1:])
    vocab = max(max(d) for d in train_docs + val_docs) + 1
    total = sum(counts.values()) + vocab
    nll = n = 0
    for d in val_docs:
        for t in d[1:]:
            nll -= math.log((counts.get(t, 0) + 1) / total)
            n += 1
    return nll / n


def doc_loss(model, docs, batch_size: int = 32) -> float:
    """Mean NLL per target token over whole documents (each starts at position 0 with <s>)."""
    import torch
    import torch.nn.functional as F

    model.eval()
    nll = 0.0
    n = 0
    with torch.no_grad():
        for i in range(0, len(docs), batch_size):
            chunk = docs[i: i + batch_size]
            width = max(len(d) for d in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for j, d in enumerate(chunk):
                ids[j, : len(d)] = torch.tensor(d)
                mask[j, : len(d)] = 1
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            tgt = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
            nll += F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), tgt.reshape(-1),
                                   ignore_index=-100, reduction="sum").item()
            n += int((tgt != -100).sum())
    model.train()
    return nll / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Train the tiny-llama sample model on CPU.")
    ap.add_argument("--data", type=Path, default=HERE / "data")
    ap.add_argument("--out", type=Path, default=HERE / "model")
    ap.add_argument("--log", type=Path, default=None, help="default: train_log.json beside --out")
    ap.add_argument("--steps", type=int, default=360)
    ap.add_argument("--batch-size", type=int, default=6)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--eval-every", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: small data slice, tiny vocab, a handful of steps")
    args = ap.parse_args(argv)

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if args.quick:
        args.steps, args.eval_every, args.vocab_size, args.batch_size = 8, 8, 512, 4
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    t_start = time.time()

    train_file = args.data / "train.txt"
    if not train_file.exists():
        sys.exit(f"{train_file} missing: run `python {HERE / 'make_corpus.py'}` first.")
    limit_train = 500 if args.quick else None
    train_lines = read_lines(train_file, limit_train)
    val_lines = read_lines(args.data / "valid.txt", 64 if args.quick else None)
    if args.quick:  # train the tokenizer on the slice only: seconds instead of minutes
        args.out.mkdir(parents=True, exist_ok=True)
        slice_file = args.out / "_train_slice.txt"
        slice_file.write_text("\n".join(train_lines) + "\n", encoding="utf-8")
        tokenizer = build_tokenizer(slice_file, args.vocab_size)
        slice_file.unlink()
    else:
        tokenizer = build_tokenizer(train_file, args.vocab_size)
    train_docs = encode_docs(tokenizer, train_lines)
    val_docs = encode_docs(tokenizer, val_lines)
    uni = unigram_ce(train_docs, val_docs)

    # Shuffle documents once (seeded) before packing, so blocks mix stories from all of training.
    order = list(range(len(train_docs)))
    random.Random(args.seed).shuffle(order)
    blocks = pack([train_docs[i] for i in order], args.block)

    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         **MODEL)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params:,}  vocab {len(tokenizer)}  train tokens {blocks.numel():,}  "
          f"blocks {len(blocks)}x{args.block}  unigram val CE {uni:.4f} nats "
          f"(ppl {math.exp(uni):.2f})", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 20)

    def lr_at(step):  # linear warm-up, cosine decay to 10 %
        if step < warmup:
            return args.lr * (step + 1) / warmup
        p = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    gen = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(len(blocks), generator=gen)
    history = []
    model.train()
    t_train = time.time()
    cursor = 0
    for step in range(args.steps):
        if cursor + args.batch_size > len(perm):  # next epoch: fresh seeded permutation
            perm, cursor = torch.randperm(len(blocks), generator=gen), 0
        batch = blocks[perm[cursor: cursor + args.batch_size]]
        cursor += args.batch_size
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last = step + 1 == args.steps
        if (step + 1) % 20 == 0 or last:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} "
                  f"lr {lr_at(step):.2e} {time.time() - t_train:.0f}s", flush=True)
        if (step + 1) % args.eval_every == 0 or last:
            vl = doc_loss(model, val_docs)
            history.append({"step": step + 1, "train_loss": round(loss.item(), 4),
                            "val_loss": round(vl, 4), "seconds": round(time.time() - t_train, 1)})
            print(f"  val loss {vl:.4f} (unigram {uni:.4f})", flush=True)
    train_seconds = time.time() - t_train
    val_fp32 = history[-1]["val_loss"]

    # Ship bf16: that is the dtype a real checkpoint arrives in and what convert reads.
    model = model.to(torch.bfloat16)
    val_bf16 = doc_loss(model, val_docs)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, max_new_tokens=64, do_sample=False)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    portable_tokenizer_files(args.out, tokenizer)

    log = {
        "model": "LlamaForCausalLM", "params": n_params, "config": MODEL,
        "vocab_size": len(tokenizer), "seed": args.seed, "threads": args.threads,
        "steps": args.steps, "batch_size": args.batch_size, "block": args.block, "lr": args.lr,
        "train_stories": len(train_lines), "val_stories": len(val_lines),
        "train_tokens": int(blocks.numel()),
        "tokens_seen": args.steps * args.batch_size * args.block,
        "unigram_val_ce": round(uni, 4), "unigram_val_ppl": round(math.exp(uni), 3),
        "val_loss_fp32": val_fp32, "val_loss_bf16": round(val_bf16, 4),
        "val_ppl_bf16": round(math.exp(val_bf16), 3),
        "train_seconds": round(train_seconds, 1), "total_seconds": round(time.time() - t_start, 1),
        "torch": torch.__version__, "history": history, "quick": args.quick,
    }
    log_path = args.log or (args.out.parent / "train_log.json" if not args.quick
                            else args.out / "train_log.json")
    log_path.write_text(json.dumps(log, indent=2) + "\n")
    print(f"val loss bf16 {val_bf16:.4f} nats (ppl {math.exp(val_bf16):.2f}) vs unigram "
          f"{uni:.4f} nats (ppl {math.exp(uni):.2f}); saved {args.out}; log {log_path}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
