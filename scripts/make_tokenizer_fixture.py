#!/usr/bin/env python3
"""Generates the byte-level BPE tokenizer fixtures under tests/fixtures/tokenizer/ (moefold
prepare --tokenizer; tests/test_data_bpe.cpp reads them).

Needs the Hugging Face `tokenizers` library (`pip install tokenizers`; CI does not: it reads the
committed fixtures). For each tokenizer style it trains a small BPE (vocabulary ~800) on the
training text below, adds the special tokens, and writes DIR/<name>/:
  tokenizer.json  as `Tokenizer.save` writes it
  text.txt        a test text unlike the training text: special tokens, text that NFC changes,
                  emoji, numbers, runs of spaces and newlines, words outside the vocabulary
  expected.json   {"tokenizers_version", "vocab_size" (max id + 1), "ids" (of text.txt),
                   "cases": [{"text", "ids"}, ...]} with ids = encode(text, add_special_tokens=False)
Styles:
  qwen2     Qwen2/Qwen3: NFC, Split(Qwen2's regex, Isolated) + ByteLevel(use_regex=false),
            <|endoftext|>, <|im_start|>, <|im_end|> (special) and <think>, </think> (not special)
            added after training (ids after the vocabulary), plus one normalized added token
  deepseek  DeepSeek-V3: empty Sequence normalizer, its three Splits (\\p{N}{1,3}; Han and kana
            runs; its word/punctuation regex) + ByteLevel(use_regex=false), special tokens
            <｜begin▁of▁sentence｜>, <｜end▁of▁sentence｜> in the vocabulary (ids 0, 1) as in the
            real file, more added after training
  gpt2      GPT-2's ByteLevel(use_regex=true) alone, no normalizer, ignore_merges=true (as
            Llama-3 sets it), <|endoftext|>, merges in the older "a b" string form
Usage: python3 scripts/make_tokenizer_fixture.py [OUT_DIR]   (default: tests/fixtures/tokenizer)
"""
import json
import os
import random
import sys

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Qwen2's tokenizer.json pre-tokenizer regex (Qwen2, Qwen2.5, Qwen3).
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek-V3's tokenizer.json: three Split pre-tokenizers, in this order.
DEEPSEEK_V3_REGEXES = [
    r"\p{N}{1,3}",
    "[一-龥\u3040-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
]

TRAIN_TEXT = """\
The quick brown fox jumps over the lazy dog. It's what they'd said: we'll see, you're right, I've done it.
Tokenizers split text into pieces; the pieces are merged byte pair by byte pair until no merge applies.
A mixture of experts routes every token to the top two experts out of eight, and balances the load.
Résumé, naïve café, façade, jalapeño, Zürich, Ångström, São Paulo, Kraków, Øresund, Œuvre, déjà vu.
résumé naïve café façade jalapeño zürich ångström são paulo kraków øresund œuvre déjà vu.

def train(model, data, steps=600):
    for step in range(steps):
        loss = model(data.next_batch())
        loss.backward()  # gradients
        optimizer.step()
    return {"loss": float(loss), "step": step}

int main(int argc, char** argv) {
  std::vector<int32_t> ids = tokenizer.encode(text);
  if (ids.empty()) return 1;   // nothing to do
  printf("%d tokens\\n", (int)ids.size());
}

Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 65536 3.14159 2.71828 1e-5 0x1F 2024-06-01 12:30:45.
Prices: $19.99, €5, £100, ¥300; percentages 12.5% and 99%; phone +1-555-0100.
Whitespace:    four spaces,\ttab,\t\ttwo tabs,
two newlines above; trailing spaces   
and CRLF line\r\nendings\r\n.

机器学习是人工智能的一个分支。我们使用混合专家模型来训练大型语言模型，每个词元被路由到两个专家。
今天天气很好，我们去公园散步吧。中文文本没有空格，分词器需要学习常见的词语。
日本語のテキストも少し含めます。ひらがなとカタカナ、そして漢字。トークナイザーのテストです。
한국어 문장도 조금 있습니다. 안녕하세요, 반갑습니다.
Русский текст: привет, мир! Ελληνικά: γειά σου κόσμε. עברית: שלום עולם. العربية: مرحبا بالعالم.
Emoji: 😀 😃 😄 🎉 🚀 👍🏽 ❤️ 👨‍👩‍👧‍👦 🇫🇷 ✅ — and symbols: → ← ≤ ≥ ≠ ∞ © ® ™ • … « » “quotes” ‘single’.
"""

QWEN2_TEXT = """\
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
Décomposé: Cafe\u0301 and re\u0301sume\u0301 and A\u030angstro\u0308m; the Angstrom sign \u212b and Kelvin \u212a;
Hangul jamo \u1100\u1161\u11a8 compose to one syllable; ﬁ ligature and ² stay (NFC is not NFKC).
Café! matches the normalized added token; so does Cafe\u0301! in its decomposed spelling.
Out-of-vocabulary words: floccinaucinihilipilification, Pneumonoultramicroscopic, zyxwvut.
Contractions: IT'S, we'LL, they'Re, you'VE, I'M, he'D.<|im_end|>
<|im_start|>assistant
<think>Counting: 1234567890 and 3.14159265 and 1,000,000.</think>
Spaces:        eight, then tabs\t\t\tand a NBSP\u00a0here, ideographic\u3000space, NEL\u0085there, MVS!\u180e! (U+180E is not \\s).


Three newlines above, CRLF below\r\n\r\nand a lone CR\rhere.
中文：混合专家模型的路由器选择两个专家。カタカナとひらがな。😀🎉👍🏿🧑‍💻🏳️‍🌈
<|endoftext|><|endoftext|>partial <|im_start| and <|endoftext without closing.<|im_end|>
"""

DEEPSEEK_TEXT = """\
<｜begin▁of▁sentence｜>You are DeepSeek. User: What is 12345678 + 987654321? Assistant: 999999999.
Digits are split in threes: 1234567890123 and ١٢٣٤٥ (Arabic-Indic) and ½ ⅓ ² ³.
Punctuation runs: !!! ??? ... --- ((( ))) "quoted" 'single' #hashtag @mention $var %mod.
Code: if(x>0){return y+1;}else{return -1;} // comment\n/* block */
中文和日本語のテキスト：機械学習、ひらがな、カタカナ、漢字混じり。한국어도.
Combining marks: e\u0301 a\u0308 n\u0303 (no normalizer: they stay decomposed); Å Å.
Spaces   and\ttabs\t\tand\n\n\nnewlines\r\n and trailing   
Emoji 😀🎉 👨‍👩‍👧 🇯🇵 and OOV words: antidisestablishmentarianism, Xylophonically.<｜end▁of▁sentence｜>
<｜User｜>Another turn.<｜Assistant｜><think>reasoning</think>answer<｜end▁of▁sentence｜>
"""

# Byte-level spellings of " floccinaucinihilipilification" and "xyzzy" (see main()).
IGNORE_MERGES_WORDS = ["Ġfloccinaucinihilipilification", "xyzzy"]

GPT2_TEXT = """\
xyzzy and floccinaucinihilipilification are whole words in the vocabulary (ignore_merges).
Hello world! It's GPT-2's regex: 's 't 're 've 'm 'll 'd but not 'S or 'LL.
Numbers 12345 and 3.14, symbols ~!@#$%^&*()_+ and    spaces   at the end   
Newlines\n\n\nand tabs\t\there. Café, naïve, 中文, 😀.<|endoftext|>Next document.<|endoftext|>
"""

# Short texts checked one by one (edge cases at piece boundaries), for every style.
CASES = [
    "",
    " ",
    "     ",
    "\n",
    "\n\n \n",
    "a",
    "hello",
    " hello",
    "hello ",
    "the the the",
    "'s",
    "x'S",
    "\u0301",
    "e\u0301",
    "1",
    "1234567",
    "<|endoftext|>",
    "<|endoftext|><|endoftext|>",
    "a<|endoftext|>b",
    "<|endoftext|",
    "<｜end▁of▁sentence｜>",
    "😀",
    "🧑‍💻",
    "中文",
    "\t\t x",
    "x   \n   y",
    "\u00a0\u3000\u0085\u2028",
]


def random_text(seed, n):
    """A mix of pieces the tokenizer must handle, in random order (fixed seed)."""
    rng = random.Random(seed)
    pieces = ["the", "The", " ", "  ", "\n", "\t", "\r\n", "e\u0301", "é", "A\u030a", "\u212b", "ﬁ", "²", "12",
              "345", "6789", "3.5", "中", "文", "日本", "カタ", "ひら", "한", "😀", "👍🏽", "‍", "'s", "'LL", "'",
              "!", "?", "...", "--", "(", ")", "{", "}", "\"", "#", "_", "x", "zq", "experts", "token", "Ω", "ß",
              "\u00a0", "\u3000", "\u0085", "<|endoftext|>", "<|im_start|>", "<｜end▁of▁sentence｜>", "<think>"]
    return "".join(rng.choice(pieces) for _ in range(n))


def train(style):
    tok = Tokenizer(models.BPE(ignore_merges=(style == "gpt2")))
    special = ["<|endoftext|>"]
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
        trainer_special = []
    elif style == "deepseek":
        tok.normalizer = normalizers.Sequence([])
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in DEEPSEEK_V3_REGEXES] +
            [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
        trainer_special = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        trainer_special = []
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, min_frequency=2, special_tokens=trainer_special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TRAIN_TEXT] * 3, trainer)
    if style == "qwen2":
        tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                        AddedToken("</think>", special=False, normalized=False),
                        # matched after NFC: the text's "Café!" in either spelling
                        AddedToken("Cafe\u0301!", special=False, normalized=True)])
    elif style == "deepseek":
        tok.add_special_tokens(["<｜User｜>", "<｜Assistant｜>"])
        tok.add_tokens([AddedToken("<think>", special=False, normalized=True),
                        AddedToken("</think>", special=False, normalized=True)])
    else:
        tok.add_special_tokens(special)
    return tok


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests",
                                                                 "fixtures", "tokenizer")
    texts = {"qwen2": QWEN2_TEXT, "deepseek": DEEPSEEK_TEXT, "gpt2": GPT2_TEXT}
    for i, (style, text) in enumerate(texts.items()):
        tok = train(style)
        d = os.path.join(out_dir, style)
        os.makedirs(d, exist_ok=True)
        tok.save(os.path.join(d, "tokenizer.json"))
        if style == "gpt2":
            # Older files (GPT-2's own) store merges as "a b" strings: cover that format too.
            with open(os.path.join(d, "tokenizer.json"), encoding="utf-8") as f:
                saved = json.load(f)
            saved["model"]["merges"] = [f"{a} {b}" for a, b in saved["model"]["merges"]]
            # Whole words in the vocabulary that no merge sequence reaches: only ignore_merges
            # makes them one token (the text has them); the added token moves up behind them.
            for word in IGNORE_MERGES_WORDS:
                saved["model"]["vocab"][word] = len(saved["model"]["vocab"])
            saved["added_tokens"][0]["id"] = len(saved["model"]["vocab"])
            with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
                json.dump(saved, f, ensure_ascii=False, indent=2)
        # Reload: the ids must be those of the saved file, as moefold reads it.
        tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        with open(os.path.join(d, "text.txt"), "w", encoding="utf-8", newline="") as f:
            f.write(text)
        cases = CASES + [random_text(1000 + i, 400)]
        expected = {
            "tokenizers_version": tokenizers.__version__,
            "vocab_size": max(tok.get_vocab(with_added_tokens=True).values()) + 1,
            "ids": tok.encode(text, add_special_tokens=False).ids,
            "cases": [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in cases],
        }
        with open(os.path.join(d, "expected.json"), "w", encoding="utf-8") as f:
            json.dump(expected, f, ensure_ascii=False, indent=None)
            f.write("\n")
        print(f"{d}: vocab_size {expected['vocab_size']}, {len(expected['ids'])} ids for {len(text)} characters")


if __name__ == "__main__":
    main()
