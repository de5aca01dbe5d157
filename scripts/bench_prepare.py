#!/usr/bin/env python3
"""Measures `moefold prepare --tokenizer` against the Hugging Face `tokenizers` library (Rust) on
the same text, on 1 and 2 threads, and checks that both give the same ids (docs/benchmarks.md,
"moefold prepare vs tokenizers").

Needs `tokenizers` in a throwaway environment (not a dependency of moefold):
  python3 -m venv /tmp/venv-tok && /tmp/venv-tok/bin/pip install tokenizers
Usage:
  /tmp/venv-tok/bin/python scripts/bench_prepare.py --moefold build/moefold [--tokenizer FILE]
      [--corpus-dir /usr/include] [--mb 64] [--threads 1,2] [--repeat 3] [--work /tmp/bench-prepare]

Steps:
  1. WORK/corpus.jsonl: the text files under --corpus-dir (sorted paths; valid UTF-8, no NUL in
     the first 8 KiB, not empty), one {"text": ...} line each, until --mb MB of text.
  2. The tokenizer: --tokenizer, else WORK/tokenizer.json, a Qwen2/Qwen3-style byte-level BPE
     (NFC, Qwen2's split regex, ByteLevel without its regex, <|endoftext|>) of --vocab ids trained
     on the Python standard library's sources (code, but not the corpus).
  3. moefold: `prepare WORK/corpus.jsonl --threads N` (plain output), wall and CPU time
     (user + system), median of --repeat runs, minus those of the same command on a one-line
     corpus (loading the tokenizer), so that both sides time tokenizing only.
  4. tokenizers: Tokenizer.encode_batch_fast (or encode_batch) over the documents, already in
     memory, in chunks of 256 documents, in a fresh process with RAYON_NUM_THREADS=N; wall and
     process CPU time, median of --repeat runs.
  5. ids: moefold's Megatron output (one sequence per document) against tokenizers' ids of each
     document plus <|endoftext|>: documents equal / all.
Prints one JSON object with every figure (MB = 10^6 bytes of document text, not of JSONL): MBps is
text over wall time, MB_per_cpu_s text over CPU seconds (per core, unaffected by other load).
"""
import argparse
import glob
import json
import os
import resource
import statistics
import struct
import subprocess
import sys
import time

QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
CHUNK_DOCS = 256


def build_corpus(corpus_dir, mb, path):
    files = []
    for root, dirs, names in os.walk(corpus_dir):
        dirs.sort()
        files.extend(os.path.join(root, n) for n in names)
    files.sort()
    total, docs = 0, 0
    with open(path, "w", encoding="utf-8") as out:
        for f in files:
            if total >= mb * 1e6:
                break
            if not os.path.isfile(f) or os.path.islink(f):
                continue
            raw = open(f, "rb").read()
            if not raw or b"\0" in raw[:8192]:
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            total += len(raw)
            docs += 1
    return total, docs


def train_tokenizer(vocab, path):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    srcs = sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True))
    tok.train(srcs, trainer)
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(path)
    return len(srcs)


def load_texts(corpus):
    with open(corpus, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def hf_worker(args):
    """In a process of its own (RAYON_NUM_THREADS fixes the pool size once): encode and time."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(args.tokenizer)
    texts = load_texts(os.path.join(args.work, "corpus.jsonl"))
    enc = getattr(tok, "encode_batch_fast", None)
    method = "encode_batch_fast"
    if enc is None:
        enc, method = tok.encode_batch, "encode_batch"
    ids = []
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(0, len(texts), CHUNK_DOCS):
        out = enc(texts[i:i + CHUNK_DOCS], add_special_tokens=False)
        if args.hf_ids:
            ids.extend(e.ids for e in out)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if args.hf_ids:
        with open(args.hf_ids, "w") as f:
            json.dump(ids, f)
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "method": method}))


def run_moefold(args, corpus, out, threads, fmt="plain"):
    cmd = [args.moefold, "prepare", corpus, "-o", out, "--tokenizer", args.tokenizer, "--threads", str(threads)]
    if fmt == "megatron":
        cmd += ["--format", "megatron"]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)


def read_megatron(prefix):
    idx = open(prefix + ".idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\0\0", prefix
    dtype = idx[17]
    n_seq, = struct.unpack_from("<Q", idx, 18)
    sizes = struct.unpack_from(f"<{n_seq}i", idx, 34)
    code = {8: "H", 4: "i"}[dtype]
    data = memoryview(open(prefix + ".bin", "rb").read()).cast(code)
    docs, pos = [], 0
    for s in sizes:
        docs.append(list(data[pos:pos + s]))
        pos += s
    return docs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--moefold", default="build/moefold")
    p.add_argument("--tokenizer", default="")
    p.add_argument("--corpus-dir", default="/usr/include")
    p.add_argument("--mb", type=float, default=64)
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--work", default="/tmp/bench-prepare")
    p.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hf-ids", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.hf_worker:
        return hf_worker(args)

    os.makedirs(args.work, exist_ok=True)
    result = {}
    corpus = os.path.join(args.work, "corpus.jsonl")
    text_bytes, docs = build_corpus(args.corpus_dir, args.mb, corpus)
    result.update(corpus_dir=args.corpus_dir, documents=docs, text_mb=text_bytes / 1e6)
    if not args.tokenizer:
        args.tokenizer = os.path.join(args.work, "tokenizer.json")
        if not os.path.exists(args.tokenizer):
            result["tokenizer_trained_on_files"] = train_tokenizer(args.vocab, args.tokenizer)
    result["tokenizer"] = args.tokenizer
    import tokenizers
    result["tokenizers_version"] = tokenizers.__version__
    result["vocab_size"] = tokenizers.Tokenizer.from_file(args.tokenizer).get_vocab_size()

    one = os.path.join(args.work, "one.jsonl")
    with open(one, "w") as f:
        f.write('{"text": "x"}\n')
    out = os.path.join(args.work, "out.tokens")
    mb = text_bytes / 1e6
    for n in [int(t) for t in args.threads.split(",")]:
        load = [run_moefold(args, one, out, n) for _ in range(args.repeat)]
        runs = [run_moefold(args, corpus, out, n) for _ in range(args.repeat)]
        load_wall, load_cpu = statistics.median(w for w, _ in load), statistics.median(c for _, c in load)
        wall, cpu = statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)
        env = dict(os.environ, RAYON_NUM_THREADS=str(n), TOKENIZERS_PARALLELISM="true")
        hf = []
        for _ in range(args.repeat):
            r = subprocess.run([sys.executable, __file__, "--hf-worker", "--tokenizer", args.tokenizer, "--work",
                                args.work], env=env, check=True, capture_output=True, text=True)
            hf.append(json.loads(r.stdout))
        hf_s = statistics.median(h["seconds"] for h in hf)
        hf_cpu = statistics.median(h["cpu_seconds"] for h in hf)
        # MBps: text over wall time (what a user waits; other load on the machine slows it);
        # MB_per_cpu_s: text over the CPU time the process used (per core, load-independent).
        result[f"threads_{n}"] = {
            "moefold_wall_s": wall, "moefold_cpu_s": cpu, "moefold_load_wall_s": load_wall,
            "moefold_MBps": mb / (wall - load_wall), "moefold_MB_per_cpu_s": mb / (cpu - load_cpu),
            "tokenizers_wall_s": hf_s, "tokenizers_cpu_s": hf_cpu, "tokenizers_MBps": mb / hf_s,
            "tokenizers_MB_per_cpu_s": mb / hf_cpu, "tokenizers_method": hf[0]["method"],
            "moefold_wall_runs": [round(w, 3) for w, _ in runs],
            "tokenizers_wall_runs": [round(h["seconds"], 3) for h in hf]}
        print(json.dumps({f"threads_{n}": result[f"threads_{n}"]}), file=sys.stderr)

    # Same ids? Megatron output keeps the documents apart.
    prefix = os.path.join(args.work, "ids")
    run_moefold(args, corpus, prefix, max(int(t) for t in args.threads.split(",")), fmt="megatron")
    ours = read_megatron(prefix)
    hf_ids = os.path.join(args.work, "hf_ids.json")
    subprocess.run([sys.executable, __file__, "--hf-worker", "--tokenizer", args.tokenizer, "--work", args.work,
                    "--hf-ids", hf_ids], check=True, capture_output=True)
    theirs = json.load(open(hf_ids))
    eos = tokenizers.Tokenizer.from_file(args.tokenizer).token_to_id("<|endoftext|>")
    same = sum(1 for a, b in zip(ours, theirs) if a == b + [eos])
    result["ids"] = {"documents_equal": same, "documents": len(theirs), "moefold_documents": len(ours),
                     "tokens": sum(len(b) + 1 for b in theirs)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
