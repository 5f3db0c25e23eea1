"""Data: record forms, loss masking, truncation, packing, and errors with file:line."""

import json
import os

import pytest

from golden_cases import BASE, CHAT, CHAT_EVAL, QWEN_BASE, REPO
from v4train import data
from v4train.tokenizer import Tokenizer

TOK = Tokenizer(os.path.join(REPO, "testdata", "sft", "tokenizer"))


def _write(tmp_path, *records):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return str(path)


def _target_text(r):
    return TOK.decode([t for t, l in zip(r.input_ids, r.labels) if l != data.IGNORE])


def test_chat_loss_is_on_assistant_tokens_only(tmp_path):
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does a cow say?"},
                         {"role": "assistant", "content": "A cow says moo."}, {"role": "user", "content": "And a cat?"},
                         {"role": "assistant", "content": "A cat says meow."}]}
    (r,) = data.read_records(_write(tmp_path, chat), TOK)
    assert TOK.decode(r.input_ids) == ("<|system|>\nBe brief.<|end|>\n<|user|>\nWhat does a cow say?<|end|>\n"
                                       "<|assistant|>\nA cow says moo.<|end|>\n<|user|>\nAnd a cat?<|end|>\n"
                                       "<|assistant|>\nA cat says meow.<|end|>\n")
    assert _target_text(r) == "A cow says moo.<|end|>\nA cat says meow.<|end|>\n"


def test_prompt_completion_text_and_tokens(tmp_path):
    records = data.read_records(_write(tmp_path, {"prompt": "2 plus 2 is", "completion": " 4."}, {"text": "A dog says woof."},
                                       {"input_ids": [5, 6, 7], "labels": [-100, 6, -100]}), TOK)
    assert _target_text(records[0]) == " 4.<|end|>"
    assert _target_text(records[1]) == "A dog says woof.<|end|>"
    assert records[2].input_ids == [5, 6, 7] and records[2].labels == [-100, 6, -100]
    assert records[2].num_targets == 1  # label 6 at position 1 is the target of position 0


def test_a_tokenizer_without_eos_token_is_said_to_leave_completions_unterminated(tmp_path):
    import shutil

    records = _write(tmp_path, {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
                     {"prompt": "The capital of France is", "completion": " Paris."}, {"text": "Snow is white."})
    notes = []
    data.read_records(records, TOK, notes=notes)
    assert notes == [], "the bundled tokenizer names its eos_token"
    noeos = tmp_path / "noeos"
    shutil.copytree(TOK.directory, noeos)
    config = json.loads((noeos / "tokenizer_config.json").read_text())
    del config["eos_token"]
    (noeos / "tokenizer_config.json").write_text(json.dumps(config))
    data.read_records(records, Tokenizer(str(noeos)), notes=notes)
    assert notes == [f"{records}: 2 prompt/completion or text record(s), the first at line 2, end with no "
                     f"end-of-sequence token: {noeos}'s tokenizer_config.json names no eos_token, so the model does "
                     "not learn to stop; set one there"]


def test_malformed_lines_are_all_reported_with_their_line(tmp_path):
    path = _write(tmp_path, {"text": "fine"}, "{broken", {"messages": [{"role": "user", "content": "hi"}]},
                  {"prompt": 3, "completion": "x"}, {"input_ids": [1, 2], "labels": [1]}, {"other": 1}, {"input_ids": [999]})
    with pytest.raises(data.DataError) as info:
        data.read_records(path, TOK, vocab_size=384)
    msg = str(info.value)
    assert msg.startswith(f"{path}: 6 malformed records:")
    for line, text in [(2, "not valid JSON"), (3, "messages has no assistant message"), (4, "prompt and completion must both be strings"),
                       (5, "labels must be a list of integers as long as input_ids (2)"),
                       (6, "expected one of messages, prompt/completion, text, input_ids"),
                       (7, "input_ids must lie in [0, 384)")]:
        assert f"{path}:{line}: {text}" in msg


def test_a_tokenizer_of_another_model_is_named_not_the_record_s_input_ids(tmp_path):
    # The bundled tokenizer has 384 ids; a model of 160 cannot take its tokens.
    path = _write(tmp_path, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "woof"}]})
    with pytest.raises(data.DataError) as info:
        data.read_records(path, TOK, vocab_size=160)
    assert f"{path}:1: the tokenizer of {TOK.directory} (384 ids) gives ids past the model's vocab_size, 160" in \
        str(info.value), str(info.value)


def test_text_records_without_a_tokenizer_are_an_error(tmp_path):
    with pytest.raises(data.DataError, match="1 'text' record\\(s\\), the first at line 1, need a tokenizer: give --tokenizer_dir"):
        data.read_records(_write(tmp_path, {"text": "x"}), None)


def test_truncation_dropping_and_the_no_trainable_token_error():
    recs = [data.Record(list(range(10)), list(range(10)), "a:1"), data.Record([1, 2], [1, 2], "a:2")]
    kept = data.fit_to_length(recs, 4, "truncate", "--seq_len=4")
    assert kept.truncated == 1 and kept.dropped == 0 and kept.examples[0].input_ids == [0, 1, 2, 3]
    dropped = data.fit_to_length(recs, 4, "drop", "--seq_len=4")
    assert dropped.dropped == 1 and [r.where for r in dropped.examples] == ["a:2"]
    masked = [data.Record([1, 2, 3], [-100, -100, -100], "b:1")]
    with pytest.raises(data.DataError, match="no trainable token"):
        data.fit_to_length(masked, 4, "truncate", "--seq_len=4")
    with pytest.raises(data.DataError, match=r"every one of the 2 examples is longer than 1 tokens \(--seq_len=1\) and "
                                             r"was dropped \(--overlong=drop\)"):
        data.fit_to_length(recs, 1, "drop", "--seq_len=1")


def test_packing_fills_rows_without_splitting_examples():
    recs = [data.Record([0] * n, [0] * n, str(n)) for n in (5, 4, 3, 6, 1)]
    assert [[r.where for r in row] for row in data.rows(recs, 9, True)] == [["5", "4"], ["3", "6"], ["1"]]
    assert len(data.rows(recs, 9, False)) == 5


def test_loader_state_resumes_the_same_batches():
    recs = [data.Record([i, i], [i, i], str(i)) for i in range(7)]
    a = data.Loader(recs, 4, True, 2, seed=3)
    first = [[r.where for r in a.next()] for _ in range(3)]
    state = a.state()
    rest = [[r.where for r in a.next()] for _ in range(4)]
    b = data.Loader(recs, 4, True, 2, seed=3)
    b.load_state(state)
    assert [[r.where for r in b.next()] for _ in range(4)] == rest


def test_bundled_eval_chats_ask_only_questions_training_never_saw():
    """The eval loss of glm5.flags measures generalisation: no eval question (or answer) appears in
    the training chats."""
    def pairs(path):
        out = set()
        with open(path) as f:
            for line in f:
                m = json.loads(line)["messages"]
                out |= {(u["content"], a["content"]) for u, a in zip(m, m[1:]) if u["role"] == "user"}
        return out

    train, held_out = pairs(CHAT), pairs(CHAT_EVAL)
    assert len(held_out) >= 20 and len(train) >= 100
    assert not {q for q, _ in held_out} & {q for q, _ in train}
    assert not {a for _, a in held_out} & {a for _, a in train}


@pytest.mark.parametrize("base", [BASE, QWEN_BASE], ids=["glm5_base", "qwen3_5_base"])
def test_the_bundled_bases_tokenize_as_transformers_does(base):
    """A user who loads a fine-tuned bundled model in transformers gets the tokens it trained on:
    transformers builds every qwen3_5 tokenizer with Qwen's own split whatever tokenizer.json says
    (the Qwen base once had GPT-2's, and 954 of the 1,200 chats tokenized otherwise)."""
    import transformers

    ours, theirs = Tokenizer(base), transformers.AutoTokenizer.from_pretrained(base)
    with open(CHAT) as f:
        chats = [json.loads(line)["messages"] for line in f]
    for n, messages in enumerate(chats, 1):
        ids, _ = ours.encode_chat(messages)
        assert ids == list(theirs.apply_chat_template(messages, tokenize=True, return_dict=False)), f"{CHAT}:{n}"
    assert ours.encode("What is 9 plus 14?") == theirs.encode("What is 9 plus 14?", add_special_tokens=False)


# Qwen3's way: an empty reasoning block on the last message only, when it is an assistant turn after
# the last user message, so a conversation's earlier renderings are no prefixes of its later ones.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last=-1) -%}{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor -%}{%- for m in messages -%}<|{{ m.role }}|>\n{% if m.role == 'assistant' and loop.index0 > "
    "ns.last and loop.last %}<think>\n\n</think>\n\n{% endif %}{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_a_template_that_rewrites_earlier_turns_trains_each_turn_as_the_model_wrote_it(tmp_path):
    """Multi-turn chats under a Qwen3-style template were refused (a QA pass): now one example per
    assistant turn, on the conversation as the template renders it when the model writes that turn."""
    import shutil

    tdir = tmp_path / "tok"
    shutil.copytree(TOK.directory, tdir)
    config = json.loads((tdir / "tokenizer_config.json").read_text())
    (tdir / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=THINKING_TEMPLATE)))
    tok = Tokenizer(str(tdir))
    chat = {"messages": [{"role": "user", "content": "What does a cow say?"}, {"role": "assistant", "content": "Moo."},
                         {"role": "user", "content": "And a cat?"}, {"role": "assistant", "content": "Meow."}]}
    notes = []
    first, second = data.read_records(_write(tmp_path, chat), tok, notes=notes)
    target = lambda r: tok.decode([t for t, l in zip(r.input_ids, r.labels) if l != data.IGNORE])  # noqa: E731
    assert tok.decode(first.input_ids) == "<|user|>\nWhat does a cow say?<|end|>\n<|assistant|>\n<think>\n\n</think>\n\nMoo.<|end|>\n"
    assert target(first) == "<think>\n\n</think>\n\nMoo.<|end|>\n"
    assert tok.decode(second.input_ids) == ("<|user|>\nWhat does a cow say?<|end|>\n<|assistant|>\nMoo.<|end|>\n"
                                            "<|user|>\nAnd a cat?<|end|>\n<|assistant|>\n<think>\n\n</think>\n\nMeow.<|end|>\n")
    assert target(second) == "<think>\n\n</think>\n\nMeow.<|end|>\n"
    assert len(notes) == 1 and "1 conversation(s), the first at line 1, each trained as one example per assistant turn" \
        in notes[0]
    (single,) = data.read_records(_write(tmp_path, {"messages": chat["messages"][:2]}), tok, notes=notes)
    assert single.input_ids == first.input_ids and len(notes) == 1, "one turn: one example, as before"
    # Two assistant turns in a row: the second's prompt holds the first as the whole conversation renders it.
    twice = {"messages": chat["messages"][:2] + [{"role": "assistant", "content": "Moo again."}]}
    _, last = data.read_records(_write(tmp_path, twice), tok)
    assert tok.decode(last.input_ids) == ("<|user|>\nWhat does a cow say?<|end|>\n<|assistant|>\nMoo.<|end|>\n"
                                          "<|assistant|>\n<think>\n\n</think>\n\nMoo again.<|end|>\n")
    assert target(last) == "<think>\n\n</think>\n\nMoo again.<|end|>\n"
