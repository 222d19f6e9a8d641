#!/usr/bin/env python3
"""Generates the fixtures under tests/fixtures/prepare/ for the data-prep tests.

Run it through scripts/make-prepare-fixtures, which sets up the pinned pyarrow / datasets /
tokenizers versions in .venv-fixtures/. The output folder is deleted and recreated on every run,
and the output is deterministic: every random draw comes from random.Random(0) (one fresh
generator per section, so that changing one section leaves the others as they are).

Files written (see tests/fixtures/prepare/README.md):

  A. pre-tokenized samples: pretok.jsonl, pretok.parquet, pretok_snappy.parquet, hf_dataset/,
     expected_pretok.json
  B. tokenizer.json: a small byte-level BPE trained here
  C. conversations.jsonl, conversations_sharegpt.jsonl, expected_conversations_chatml.json,
     expected_conversations_llama3.json

Reference procedure for conversations (the Rust implementation follows the same rules):

  1. Render the conversation to one string and record the character spans of the assistant
     turns ("assistant spans"). Role names in the rendered text are always system / user /
     assistant (ShareGPT human -> user, gpt -> assistant).
       chatml: per message "<|im_start|>" + role + "\\n" + content + "<|im_end|>\\n", content used
               as is (no trimming). Assistant span = content + "<|im_end|>" (not the "\\n").
       llama3: "<|begin_of_text|>", then per message "<|start_header_id|>" + role +
               "<|end_header_id|>\\n\\n" + content.strip() + "<|eot_id|>".
               Assistant span = content.strip() + "<|eot_id|>".
  2. Encode the whole string once: tokenizer.encode(text, add_special_tokens=False);
     input_ids = encoding.ids.
  3. loss_mask[t] = 1 if the offsets (start, end) of token t lie fully inside an assistant span
     (span_start <= start and end <= span_end), else 0. Offsets here are character offsets (the
     Python binding's); with byte offsets and byte spans the result is the same.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

datasets.disable_progress_bars()

SEED = 0
MIN_LOSS_TOKENS = 32

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

# --------------------------------------------------------------------------------------------
# Output helpers
# --------------------------------------------------------------------------------------------


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def write_jsonl(path: Path, rows) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(dumps(row) + "\n")


def write_json_list(path: Path, rows) -> None:
    """A JSON list with one compact element per line (small diffs, easy to eyeball)."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write("[\n")
        f.write(",\n".join(dumps(row) for row in rows))
        f.write("\n]\n")


# --------------------------------------------------------------------------------------------
# A. Pre-tokenized samples
# --------------------------------------------------------------------------------------------

NUM_PRETOK = 40


def make_pretok_samples() -> list[dict]:
    """Sample i: L ~ U[40, 300], ids ~ U[0, 1000). Even i: explicit mask, 0 for the first L // 5
    positions and 1 after (>= 32 ones since L >= 40). Odd i: no mask (= all ones)."""
    rng = random.Random(SEED)
    samples = []
    for i in range(NUM_PRETOK):
        length = rng.randint(40, 300)
        input_ids = [rng.randrange(1000) for _ in range(length)]
        if i % 2 == 0:
            masked = length // 5
            loss_mask = [0] * masked + [1] * (length - masked)
        else:
            loss_mask = None
        samples.append({"id": f"s{i}", "input_ids": input_ids, "loss_mask": loss_mask})
    return samples


def write_pretok(out: Path, samples: list[dict]) -> None:
    # JSONL: keys id, input_ids, loss_mask (only where present), source. Samples with
    # i % 4 == 2 write the mask as JSON booleans.
    rows = []
    for i, s in enumerate(samples):
        row = {"id": s["id"], "input_ids": s["input_ids"]}
        if s["loss_mask"] is not None:
            if i % 4 == 2:
                row["loss_mask"] = [bool(m) for m in s["loss_mask"]]
            else:
                row["loss_mask"] = s["loss_mask"]
        row["source"] = "fixture"
        rows.append(row)
    write_jsonl(out / "pretok.jsonl", rows)

    ids = [s["id"] for s in samples]
    input_ids = [s["input_ids"] for s in samples]
    masks = [s["loss_mask"] for s in samples]

    # Parquet, zstd, list<int64> columns, mask null where absent, row groups of 16 rows.
    table = pa.table(
        {
            "id": pa.array(ids, type=pa.string()),
            "input_ids": pa.array(input_ids, type=pa.list_(pa.int64())),
            "loss_mask": pa.array(masks, type=pa.list_(pa.int64())),
        }
    )
    pq.write_table(table, out / "pretok.parquet", row_group_size=16, compression="zstd")

    # Parquet, snappy, list<int32> ids and list<bool> mask, one row group.
    table = pa.table(
        {
            "id": pa.array(ids, type=pa.string()),
            "input_ids": pa.array(input_ids, type=pa.list_(pa.int32())),
            "loss_mask": pa.array(
                [None if m is None else [bool(v) for v in m] for m in masks],
                type=pa.list_(pa.bool_()),
            ),
        }
    )
    pq.write_table(
        table, out / "pretok_snappy.parquet", row_group_size=len(samples), compression="snappy"
    )
    assert pq.ParquetFile(out / "pretok_snappy.parquet").num_row_groups == 1
    assert pq.ParquetFile(out / "pretok.parquet").num_row_groups == -(-len(samples) // 16)

    # Hugging Face dataset (save_to_disk, two shards). datasets needs a value for every row, so
    # samples without a mask get an explicit all-ones mask here.
    full_masks = [m if m is not None else [1] * len(ids_) for m, ids_ in zip(masks, input_ids)]
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
        }
    )
    ds = datasets.Dataset.from_dict(
        {"id": ids, "input_ids": input_ids, "loss_mask": full_masks}, features=features
    )
    ds.save_to_disk(str(out / "hf_dataset"), num_shards=2)
    shards = sorted(p.name for p in (out / "hf_dataset").glob("*.arrow"))
    assert shards == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"], shards

    # What the Rust store must read back: masks always explicit 0/1.
    write_json_list(
        out / "expected_pretok.json",
        [{"input_ids": s["input_ids"], "loss_mask": m} for s, m in zip(samples, full_masks)],
    )


# --------------------------------------------------------------------------------------------
# Word lists shared by the tokenizer corpus and the conversations
# --------------------------------------------------------------------------------------------

SUBJECTS = [
    "the model", "a student", "the teacher", "our team", "the system", "my friend", "the engineer",
    "this dataset", "the baker", "a traveller", "the committee", "the river", "every batch",
    "the tokenizer", "the old library", "a small robot", "the garden", "the orchestra",
]
VERBS = [
    "reads", "writes", "builds", "measures", "explains", "follows", "collects", "trains",
    "compares", "visits", "describes", "repairs", "shares", "learns", "counts", "prepares",
    "remembers", "carries", "discovers", "improves",
]
OBJECTS = [
    "the report", "a long letter", "the results", "three examples", "the map", "every token",
    "a quiet song", "the weather", "the recipe", "a new plan", "the numbers", "the garden path",
    "a careful answer", "the training loss", "the menu", "the mountains", "a simple question",
]
ADVERBS = [
    "slowly", "carefully", "quickly", "again", "today", "every morning", "without a word",
    "with great care", "before lunch", "after the storm", "in the evening", "at the station",
]
CONNECTORS = ["and then", "because", "while", "although", "so", "but", "after that", "meanwhile"]
EXTRA_WORDS = [
    "café", "naïve", "日本語", "über", "façade", "jalapeño", "résumé", "Zürich", "São Paulo",
    "crème brûlée", "smörgåsbord", "piñata", "déjà vu", "Ελληνικά", "🙂",
]
NUMBERS = ["2", "7", "12", "42", "100", "365", "2048", "3.14"]


def sentence(rng: random.Random, extra_prob: float = 0.25) -> str:
    parts = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
    if rng.random() < 0.6:
        parts.append(rng.choice(ADVERBS))
    if rng.random() < 0.5:
        parts += [rng.choice(CONNECTORS), rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
    if rng.random() < extra_prob:
        parts.insert(rng.randrange(2, len(parts) + 1), "near the " + rng.choice(EXTRA_WORDS))
    if rng.random() < 0.2:
        parts.append("about " + rng.choice(NUMBERS) + " times")
    text = " ".join(parts)
    if rng.random() < 0.2:
        words = text.split(" ")
        k = rng.randrange(1, len(words))
        words[k - 1] += ","
        text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "!", "?"])


# --------------------------------------------------------------------------------------------
# B. Tokenizer
# --------------------------------------------------------------------------------------------


def make_corpus() -> list[str]:
    rng = random.Random(SEED)
    corpus = []
    for _ in range(400):
        n = rng.randint(1, 3)
        corpus.append(" ".join(sentence(rng) for _ in range(n)))
    # Make sure every non-ASCII word is seen a few times.
    for word in EXTRA_WORDS:
        for _ in range(3):
            corpus.append(f"{sentence(rng, 0.0)[:-1]} with {word}.")
    return corpus


def train_tokenizer(out: Path) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # trim_offsets=False: offsets cover the whole token, leading space included.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(make_corpus(), trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 600, tokenizer.get_vocab_size()
    for i, tok in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(tok) == i, (tok, tokenizer.token_to_id(tok))
        assert tokenizer.encode(tok, add_special_tokens=False).ids == [i], tok
        assert tokenizer.encode(f"a{tok}b", add_special_tokens=False).ids[1] == i, tok
    return tokenizer


# --------------------------------------------------------------------------------------------
# C. Conversations
# --------------------------------------------------------------------------------------------

NUM_CONVERSATIONS = 12
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a careful assistant who answers in plain English, even about the café menu.",
    "You answer briefly and precisely.",
]
QUESTIONS = [
    "Can you tell me why {s} {v3} {o}?",
    "Why does {s} always {v} {o}?",
    "How would you explain why {s} {v3} {o}?",
    "Please describe how {s} {v3} {o}.",
    "What happens when {s} {v3} {o} near the {x}?",
]


def words(text: str) -> int:
    return len(text.split())


def base_form(verb: str) -> str:
    return verb[:-3] + "y" if verb.endswith("ies") else verb[:-1]


def user_message(rng: random.Random) -> str:
    verb = rng.choice(VERBS)
    q = rng.choice(QUESTIONS).format(
        s=rng.choice(SUBJECTS), v=base_form(verb), v3=verb, o=rng.choice(OBJECTS),
        x=rng.choice(EXTRA_WORDS),
    )
    if rng.random() < 0.5:
        q = sentence(rng) + " " + q
    return q


def assistant_message(rng: random.Random) -> str:
    paragraphs = []
    total = 0
    while total < 40 or rng.random() < 0.3:
        para = " ".join(sentence(rng, 0.35) for _ in range(rng.randint(1, 3)))
        if rng.random() < 0.25:
            para += "\n- " + sentence(rng) + "\n- " + sentence(rng)
        paragraphs.append(para)
        total = sum(words(p) for p in paragraphs)
    text = "\n\n".join(paragraphs)
    assert words(text) >= 40
    return text


def make_conversations() -> list[dict]:
    rng = random.Random(SEED)
    conversations = []
    for i in range(NUM_CONVERSATIONS):
        messages = []
        if i % 4 == 0:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _ in range(rng.randint(1, 3)):
            user = user_message(rng)
            assistant = assistant_message(rng)
            if i in (3, 7):
                # Leading/trailing whitespace: kept by chatml, stripped by llama3.
                user = "  " + user + "\n"
                assistant = "\n\n " + assistant + "  \n"
            messages.append({"role": "user", "content": user})
            messages.append({"role": "assistant", "content": assistant})
        conversations.append({"id": f"c{i}", "conversations": messages})
    # Every conversation has at least one non-ASCII character somewhere.
    for conv in conversations:
        if all(m["content"].isascii() for m in conv["conversations"]):
            last = conv["conversations"][-1]
            last["content"] = last["content"].rstrip() + " Bon appétit, 日本語 🙂." + (
                last["content"][len(last["content"].rstrip()):]
            )
    return conversations


SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def to_sharegpt(conv: dict) -> dict:
    return {
        "id": conv["id"],
        "conversations": [
            {"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in conv["conversations"]
        ],
    }


def render_chatml(messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    text = ""
    spans = []
    for m in messages:
        text += "<|im_start|>" + m["role"] + "\n"
        start = len(text)
        text += m["content"] + "<|im_end|>"
        if m["role"] == "assistant":
            spans.append((start, len(text)))
        text += "\n"
    return text, spans


def render_llama3(messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    text = "<|begin_of_text|>"
    spans = []
    for m in messages:
        text += "<|start_header_id|>" + m["role"] + "<|end_header_id|>\n\n"
        start = len(text)
        text += m["content"].strip() + "<|eot_id|>"
        if m["role"] == "assistant":
            spans.append((start, len(text)))
    return text, spans


def tokenize_conversation(tokenizer: Tokenizer, template: str, messages: list[dict]) -> dict:
    render = {"chatml": render_chatml, "llama3": render_llama3}[template]
    text, spans = render(messages)
    enc = tokenizer.encode(text, add_special_tokens=False)
    loss_mask = [
        1 if any(s <= start and end <= e for s, e in spans) else 0 for start, end in enc.offsets
    ]
    # Sanity checks: the text round-trips, the template's special tokens are single tokens.
    assert tokenizer.decode(enc.ids, skip_special_tokens=False) == text
    if template == "chatml":
        assert enc.ids.count(tokenizer.token_to_id("<|im_start|>")) == len(messages)
        assert enc.ids.count(tokenizer.token_to_id("<|im_end|>")) == len(messages)
    else:
        assert enc.ids.count(tokenizer.token_to_id("<|begin_of_text|>")) == 1
        for tok in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
            assert enc.ids.count(tokenizer.token_to_id(tok)) == len(messages), tok
    n_assistant = sum(m["role"] == "assistant" for m in messages)
    end_id = tokenizer.token_to_id("<|im_end|>" if template == "chatml" else "<|eot_id|>")
    assert sum(1 for t, m in zip(enc.ids, loss_mask) if t == end_id and m) == n_assistant
    assert sum(loss_mask) >= MIN_LOSS_TOKENS, (template, sum(loss_mask))
    return {"input_ids": enc.ids, "loss_mask": loss_mask}


def write_conversations(out: Path, tokenizer: Tokenizer) -> list[dict]:
    conversations = make_conversations()
    for conv in conversations:
        roles = [m["role"] for m in conv["conversations"]]
        if roles[0] == "system":
            roles = roles[1:]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and 2 <= len(roles) <= 6, roles
    write_jsonl(out / "conversations.jsonl", conversations)
    write_jsonl(out / "conversations_sharegpt.jsonl", [to_sharegpt(c) for c in conversations])
    for template in ("chatml", "llama3"):
        expected = [
            tokenize_conversation(tokenizer, template, c["conversations"]) for c in conversations
        ]
        write_json_list(out / f"expected_conversations_{template}.json", expected)
    return conversations


# --------------------------------------------------------------------------------------------

README = """\
# Fixtures for the data-prep tests

Generated by `scripts/make-prepare-fixtures` (which runs `scripts/make_prepare_fixtures.py` with
pinned pyarrow / datasets / tokenizers in `.venv-fixtures/`). Do not edit by hand: rerun the
script, which deletes and recreates this folder. The output is deterministic.

Pre-tokenized samples (40 samples, lengths 40..300, ids in [0, 1000)). Even samples carry a loss
mask (0 for the first `len // 5` positions, 1 after); odd samples have none (all ones).

- `pretok.jsonl`: `{"id", "input_ids", "loss_mask"?, "source"}` per line; samples with
  `i % 4 == 2` write the mask as `true`/`false`.
- `pretok.parquet`: `id` string, `input_ids` `list<int64>`, `loss_mask` `list<int64>` (null
  where absent); zstd, row groups of 16 rows.
- `pretok_snappy.parquet`: `input_ids` `list<int32>`, `loss_mask` `list<bool>` (null where
  absent); snappy, one row group.
- `hf_dataset/`: `datasets` `save_to_disk` output, two shards; `input_ids` int32, `loss_mask`
  int8 (all ones where the sample has no mask).
- `expected_pretok.json`: the 40 samples as they must be read back, mask always explicit 0/1.

Tokenizer and conversations:

- `tokenizer.json`: byte-level BPE, vocab 600, trained on generated sentences. Special tokens
  0..6: `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<|begin_of_text|>`,
  `<|start_header_id|>`, `<|end_header_id|>`, `<|eot_id|>`.
- `conversations.jsonl`: 12 conversations, `{"id", "conversations": [{"role", "content"}]}`.
  c0, c4, c8 start with a system message; c3 and c7 have leading/trailing whitespace in their
  messages.
- `conversations_sharegpt.jsonl`: the same in ShareGPT form (`from`: system/human/gpt, `value`).
- `expected_conversations_chatml.json`, `expected_conversations_llama3.json`: `input_ids` and
  `loss_mask` per conversation for each template.

How the expected conversation tokens are computed (see the docstring of
`scripts/make_prepare_fixtures.py`): render the conversation with the template
(chatml: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, content as is; llama3:
`<|begin_of_text|>` then `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content.strip()}<|eot_id|>`
per message), encode the whole text once without added special tokens, and set the mask to 1 for
tokens whose offsets lie fully inside an assistant span (the assistant content followed by its
`<|im_end|>` / `<|eot_id|>`).
"""


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    out = root / "tests" / "fixtures" / "prepare"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "README.md").write_text(README, encoding="utf-8")

    write_pretok(out, make_pretok_samples())
    tokenizer = train_tokenizer(out)
    write_conversations(out, tokenizer)

    print(f"wrote {out.relative_to(root)}:")
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        print(f"  {path.relative_to(out)}  {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
