"""Chat JSONL data: rendering equals transformers' apply_chat_template, the loss mask covers exactly the
assistant tokens, bad records name their file and line, padding and other conversations change nothing,
and the step's loss is the token mean over the whole global batch.

Expected masks are built independently of the code under test: by writing the ChatML text by hand, or
from transformers' own assistant mask (`return_assistant_tokens_mask` with `{% generation %}` markers).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fourfold.chat import ChatTemplate
from fourfold.config import DataConfig, ModelConfig, build_config
from fourfold.errors import ConfigError
from fourfold.mesh import ParallelMesh
from fourfold.models.llama import Llama
from fourfold.ops.cross_entropy import IGNORE_INDEX
from fourfold.parallel.data_parallel import build_data_parallel
from fourfold.tokenizer import ByteTokenizer, HFTokenizer
from fourfold.train.chat_data import (ChatSequences, build_chat_cache, chat_sequences, chat_template_for,
                                      encode_record, read_records)
from fourfold.train.dataset import build_data, data_format
from fourfold.train.runner import build_runner
from tests.trainer_helpers import tiny_config

# A SmolLM2-Instruct-like ChatML template with a default system turn, written for this test.
SMOL_LIKE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
             "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
             "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# The same text with Hugging Face's assistant markers around what must be trained: transformers' reference mask.
SMOL_LIKE_MARKED = SMOL_LIKE.replace(
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}",
    "{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}"
    "{% endif %}{{ '\n' }}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Count to three"},
     {"role": "assistant", "content": "one two three"}],
    [{"role": "user", "content": "Say something with a newline"},
     {"role": "assistant", "content": "line one\nline two  "}],
]


def write_hf_dir(folder: Path, template: str, sentencepiece_like: bool = False) -> Path:
    """A BPE tokenizer.json with ChatML special tokens and a tokenizer_config.json (no downloads): byte-level
    (GPT-2, Llama 3, SmolLM2), or sentencepiece-like (Llama 2: '▁' for spaces, one prepended to the text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>" if sentencepiece_like else None))
    if sentencepiece_like:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
        alphabet = []
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=alphabet)
    corpus = [m["content"] for conv in CONVERSATIONS for m in conv] + ["assistant user system helpful"] * 4
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "bos_token": "<|im_start|>",
              "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def hf_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# ----- rendering equals transformers ------------------------------------------------------------------

@pytest.mark.parametrize("template", [None, SMOL_LIKE], ids=["default", "smollm2-like"])
def test_rendering_and_ids_equal_apply_chat_template(tmp_path, template):
    folder = write_hf_dir(tmp_path / "model", template or ChatTemplate().source)
    ours, theirs = ChatTemplate.for_model_dir(folder), hf_tokenizer(folder)
    tokenizer = HFTokenizer(folder / "tokenizer.json")
    for conv in CONVERSATIONS:
        for gen in (False, True):
            assert ours.render(conv, add_generation_prompt=gen) == theirs.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=gen)
        ids, _ = encode_record({"messages": conv}, tokenizer, ours)
        expected = theirs.apply_chat_template(conv, tokenize=True)
        assert ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)


# ----- the loss mask ---------------------------------------------------------------------------------

def test_default_template_mask_with_the_byte_tokenizer_is_exactly_the_assistant_bytes():
    """Hand-written ChatML: each assistant content plus its <|im_end|> is trained, nothing else."""
    conv = CONVERSATIONS[1]
    text, trained_chars = "", []
    for m in conv:
        header, body, tail = f"<|im_start|>{m['role']}\n", m["content"] + "<|im_end|>", "\n"
        text += header + body + tail
        trained_chars += [False] * len(header) + [m["role"] == "assistant"] * len(body) + [False] * len(tail)
    ids, trained = encode_record({"messages": conv}, ByteTokenizer(), ChatTemplate())
    assert ids == list(text.encode())  # ASCII: one byte per character
    assert trained == trained_chars


@pytest.mark.parametrize("sentencepiece_like", [False, True], ids=["byte-level", "sentencepiece-like"])
def test_realistic_template_mask_equals_transformers_assistant_mask(tmp_path, sentencepiece_like):
    """SmolLM2-like template (default system turn): our ids and mask equal transformers' (its mask from the
    generation markers), with a byte-level and with a sentencepiece-like tokenizer."""
    folder = write_hf_dir(tmp_path / "model", SMOL_LIKE, sentencepiece_like)
    marked = hf_tokenizer(write_hf_dir(tmp_path / "marked", SMOL_LIKE_MARKED, sentencepiece_like))
    tokenizer, template = HFTokenizer(folder / "tokenizer.json"), ChatTemplate.for_model_dir(folder)
    for conv in CONVERSATIONS:
        ids, trained = encode_record({"messages": conv}, tokenizer, template)
        ref = marked.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == list(ref["input_ids"])
        assert trained == [bool(x) for x in ref["assistant_masks"]]
        runs, run = [], []  # the trained tokens, as runs of consecutive positions
        for i, t in zip(ids + [None], trained + [False]):
            if t:
                run.append(i)
            elif run:
                runs, run = runs + [run], []
        decoded = [marked.decode(r, skip_special_tokens=False) for r in runs]
        answers = [m["content"] + "<|im_end|>" for m in conv if m["role"] == "assistant"]
        assert len(decoded) == len(answers)
        for got, answer in zip(decoded, answers):  # a sentencepiece-like token may carry the header's "\n" along
            assert got.endswith(answer) and got[:len(got) - len(answer)] in ("", "\n")


def test_template_that_rewrites_earlier_turns_falls_back_to_searching():
    """A template whose prefixes are not prefixes of the whole text (it marks the last turn) still masks right."""
    template = ChatTemplate("{% for m in messages %}{% if loop.last %}*{% endif %}[{{ m['role'] }}]{{ m['content'] }}"
                            "<|im_end|>{% endfor %}")
    conv = CONVERSATIONS[1]
    text, spans = template.render_with_spans(conv)
    assert [text[s:e] for s, e in spans] == [m["content"] + "<|im_end|>" for m in conv if m["role"] == "assistant"]


def test_text_records_train_every_token_and_end_with_eos():
    ids, trained = encode_record({"text": "plain words"}, ByteTokenizer(), ChatTemplate())
    assert ids == list(b"plain words") + [ByteTokenizer.eos_id] and all(trained)


# ----- records and their errors ----------------------------------------------------------------------

@pytest.mark.parametrize("line, problem", [
    ('{"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}', "messages\\[0\\]"),
    ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "yo"}]}', "string"),
    ('{"messages": []}', "non-empty"),
    ('{"messages": [{"role": "user", "content": "hi"}', "not valid JSON"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant"),
    ('{"text": 5}', "'text' must be a string"),
    ('{"prompt": "x"}', "exactly one of"),
    ('[1, 2]', "exactly one of"),
])
def test_bad_records_name_the_file_and_line(tmp_path, line, problem):
    good = {"messages": CONVERSATIONS[0]}
    path = write_jsonl(tmp_path / "chat.jsonl", [good, "", line])  # the bad record is on line 3
    with pytest.raises(ConfigError, match=f"chat.jsonl:3: .*{problem}"):
        read_records([path])


def test_blank_lines_are_skipped_and_an_empty_file_is_an_error(tmp_path):
    assert len(read_records([write_jsonl(tmp_path / "a.jsonl", ["", {"text": "x"}, "  "])])) == 1
    with pytest.raises(ConfigError, match="hold no records"):
        read_records([write_jsonl(tmp_path / "b.jsonl", [""])])


# ----- sequences: padding, truncation, splits --------------------------------------------------------

def _sequences(tmp_path, records, seq_len, val_fraction=0.0, **kw):
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), val_fraction=val_fraction, **kw)
    return chat_sequences(cfg, [path], seq_len, ByteTokenizer(), ChatTemplate(), is_writer=True)


def test_pairs_are_padded_and_targets_ignore_prompt_and_padding(tmp_path):
    train, _ = _sequences(tmp_path, [{"messages": CONVERSATIONS[0]}], seq_len=160)
    ids, trained = encode_record({"messages": CONVERSATIONS[0]}, ByteTokenizer(), ChatTemplate())
    inputs, targets = train.pair(0)
    n = len(ids) - 1
    assert inputs.tolist() == ids[:-1] + [ByteTokenizer.eos_id] * (160 - n)
    assert targets.tolist() == [t if k else IGNORE_INDEX for t, k in zip(ids[1:], trained[1:])] + \
        [IGNORE_INDEX] * (160 - n)


def test_truncation_is_counted_and_warned_and_empty_records_dropped(tmp_path):
    long_answer = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * 80}]}
    long_prompt = {"messages": [{"role": "user", "content": "y" * 80}, {"role": "assistant", "content": "ok"}]}
    with pytest.warns(UserWarning, match="2 record\\(s\\) longer .* 1 record\\(s\\) left with no assistant"):
        train, _ = _sequences(tmp_path, [long_answer, long_prompt, {"text": "short"}], seq_len=63)
    assert len(train) == 2 and train.truncated == 2 and train.dropped == 1
    inputs, targets = train.pair(0)
    assert inputs.shape == targets.shape == (63,) and (targets != IGNORE_INDEX).sum() > 0


def test_validation_split_is_the_last_records(tmp_path):
    records = [{"text": f"document {i}"} for i in range(10)]
    train, val = _sequences(tmp_path, records, seq_len=32, val_fraction=0.25)
    assert len(train) == 7 and len(val) == 3
    assert bytes(val.pair(0)[0][:10].tolist()).decode() == "document 7"


def test_cache_is_reused_and_keyed_by_template(tmp_path, monkeypatch):
    from fourfold.train import chat_data

    calls = []
    monkeypatch.setattr(chat_data, "build_chat_cache", lambda *a: calls.append(1) or build_chat_cache(*a))
    _sequences(tmp_path, [{"messages": CONVERSATIONS[0]}], seq_len=128)
    _sequences(tmp_path, [{"messages": CONVERSATIONS[0]}], seq_len=120)  # seq_len is applied when reading
    assert len(calls) == 1
    path = tmp_path / "chat.jsonl"
    cfg = DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), val_fraction=0.0)
    chat_sequences(cfg, [path], 128, ByteTokenizer(), ChatTemplate("{% for m in messages %}{{ m['content'] }}|"
                                                                   "{% endfor %}"), is_writer=True)
    assert len(calls) == 2


# ----- config: format and template resolution --------------------------------------------------------

def test_format_auto_detects_jsonl_and_template_resolution(tmp_path):
    (tmp_path / "d").mkdir()
    jsonl = write_jsonl(tmp_path / "d" / "chat.jsonl", [{"text": "x"}])
    assert data_format(DataConfig(path=str(jsonl))) == "jsonl"
    (tmp_path / "d" / "notes.txt").write_text("text")
    assert data_format(DataConfig(path=str(tmp_path / "d"))) == "text"  # mixed: the corpus as text
    assert data_format(DataConfig(path=str(tmp_path / "d"), format="jsonl")) == "jsonl"
    assert data_format(DataConfig()) == "text"
    with pytest.raises(ConfigError, match="needs data.path"):
        data_format(DataConfig(format="jsonl"))

    model = write_hf_dir(tmp_path / "model", SMOL_LIKE)
    assert chat_template_for(DataConfig(tokenizer=str(model / "tokenizer.json"))).source == SMOL_LIKE
    assert chat_template_for(DataConfig(tokenizer=str(model / "tokenizer.json"), chat_template="default")).source \
        == ChatTemplate().source
    assert chat_template_for(DataConfig(chat_template=str(model))).source == SMOL_LIKE
    assert chat_template_for(DataConfig(chat_template=str(model / "tokenizer_config.json"))).source == SMOL_LIKE
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert chat_template_for(DataConfig(chat_template=str(tmp_path / "t.jinja"))).source.startswith("{{")
    assert chat_template_for(DataConfig()).source == ChatTemplate().source  # byte tokenizer: the default
    with pytest.raises(ConfigError, match="without tokenizer_config.json"):
        chat_template_for(DataConfig(chat_template=str(tmp_path / "d")))
    with pytest.raises(ConfigError, match="neither"):
        chat_template_for(DataConfig(chat_template=str(tmp_path / "missing")))


def test_build_data_on_the_example_file(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "chat_tiny.jsonl"
    cfg = build_config({}, {"data.path": str(example), "data.cache_dir": str(tmp_path), "train.seq_len": "192",
                            "train.global_batch": "4", "train.micro_batch": "2", "model.vocab_size": "320",
                            "data.val_fraction": "0.1"})
    tok, batches, val = build_data(cfg, 0, 1, is_writer=True)
    assert len(read_records([example])) >= 30 and len(batches.dataset) >= 30 and len(val) == cfg.train.val_batches
    (inputs, targets), _ = batches.next_step()
    assert inputs.shape == targets.shape == (2, 192)
    assert 0 < (targets != IGNORE_INDEX).sum() < targets.numel()


# ----- the model never mixes conversations; the loss is the global token mean ------------------------

def _tiny_model(seed=0):
    torch.manual_seed(seed)
    return Llama(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=320,
                             max_seq_len=128)).double()


def test_padding_and_other_conversations_change_nothing(tmp_path):
    train, _ = _sequences(tmp_path, [{"messages": c} for c in CONVERSATIONS[:2]], seq_len=128)
    (a_in, a_tgt), (b_in, b_tgt) = train.pair(0), train.pair(1)
    model = _tiny_model()
    inputs, targets = torch.stack([a_in, b_in]), torch.stack([a_tgt, b_tgt])
    logits = model(inputs)
    real_a = int((a_in != ByteTokenizer.eos_id).sum())  # ASCII conversations: eos appears only as padding

    changed = inputs.clone()
    changed[0, real_a:] = torch.randint(0, 256, (128 - real_a,))  # other padding ids in row A
    changed[1, :40] = torch.randint(0, 256, (40,))  # conversation B's own tokens changed
    other = model(changed)
    torch.testing.assert_close(other[0, :real_a], logits[0, :real_a], rtol=0, atol=0)  # A never sees its padding
    assert not torch.allclose(other[1], logits[1])

    changed = inputs.clone()
    changed[0, :real_a] = torch.randint(0, 256, (real_a,))  # conversation A replaced
    torch.testing.assert_close(model(changed)[1], logits[1], rtol=0, atol=0)  # B's logits untouched

    # other padding ids leave the loss and every gradient exactly as they were
    def loss_and_grads(tokens):
        model.zero_grad(set_to_none=True)
        value = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        value.backward()
        return value.detach(), [p.grad.clone() for p in model.parameters()]

    repadded = inputs.clone()
    repadded[0, real_a:] = torch.randint(0, 256, (128 - real_a,))
    (loss_a, grads_a), (loss_b, grads_b) = loss_and_grads(inputs), loss_and_grads(repadded)
    assert loss_a == loss_b and all(torch.equal(g, h) for g, h in zip(grads_a, grads_b))

    # padded and prompt positions add nothing: the loss equals the loss over the trained positions alone
    keep = targets != IGNORE_INDEX
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    by_hand = -torch.log_softmax(logits, -1)[keep].gather(1, targets[keep][:, None]).mean()
    torch.testing.assert_close(loss, by_hand, rtol=1e-12, atol=0)


def test_step_loss_is_the_token_mean_of_the_global_batch_whatever_the_micro_batch(tmp_path):
    """Micro-batches with different numbers of trained tokens: the loss and gradient are those of the mean
    over all trained tokens of the step (a mean of per-micro-batch means would differ)."""
    records = [{"messages": c} for c in CONVERSATIONS] + [{"text": "a document of some length " * 3}]
    train, _ = _sequences(tmp_path, records, seq_len=128)
    pairs = [train.pair(i) for i in range(4)]
    inputs, targets = torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])
    reference = _tiny_model()
    logits = reference(inputs)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    expected.backward()
    per_micro = [(targets[i:i + 2] != IGNORE_INDEX).sum() for i in (0, 2)]
    assert per_micro[0] != per_micro[1]  # so that a mean of means would not agree

    for micro in (1, 2, 4):
        cfg = tiny_config(tmp_path, **{"compute.precision": "fp64", "optim.grad_clip": 0,
                                       "train.micro_batch": micro, "train.global_batch": 4})
        model = copy.deepcopy(reference)
        model.zero_grad(set_to_none=True)
        mesh = ParallelMesh.build(cfg)
        runner = build_runner(cfg, mesh, build_data_parallel(mesh, cfg.parallel, cfg.optim, torch.device("cpu")),
                              [model], torch.device("cpu"))
        batches = [(inputs[i:i + micro], targets[i:i + micro]) for i in range(0, 4, micro)]
        loss, _, _ = runner.step(batches)
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=0)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(runner.evaluate(batches), expected.detach(), rtol=1e-12, atol=0)


def test_template_saved_as_chat_template_jinja_is_found(tmp_path):
    """Recent transformers save the template in chat_template.jinja next to a tokenizer_config.json without one."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (folder / "chat_template.jinja").write_text(SMOL_LIKE)
    template = ChatTemplate.for_model_dir(folder)
    assert template.source == SMOL_LIKE and template.eos_token == "<|im_end|>"


def test_check_data_source_reads_every_record_before_training(tmp_path):
    from fourfold.train.dataset import check_data_source

    bad = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}, {"messages": [{"role": "user"}]}])
    cfg = build_config({}, {"data.path": str(bad), "model.vocab_size": "320"})
    with pytest.raises(ConfigError, match="chat.jsonl:2: "):
        check_data_source(cfg)


def test_fallback_finds_an_answer_after_a_question_with_the_same_text():
    template = ChatTemplate("{% for m in messages %}{% if loop.last %}*{% endif %}{{ m['content'] }}<|im_end|>"
                            "{% endfor %}")
    conv = [{"role": "user", "content": "Yes."}, {"role": "assistant", "content": "Yes."}]
    text, spans = template.render_with_spans(conv)
    assert text == "Yes.<|im_end|>*Yes.<|im_end|>" and spans == [(15, len(text))]


def test_fine_tune_a_hugging_face_model_on_chat_data_from_the_command_line(tmp_path):
    """The whole path: an HF Llama directory (weights, tokenizer.json, tokenizer_config.json with its chat
    template) as checkpoint.init_from, chat JSONL as data; its shape (vocab 400) is the one checked."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fourfold.cli import main
    from fourfold.train.metrics import read_metrics

    folder = write_hf_dir(tmp_path / "hf", SMOL_LIKE)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=128)).save_pretrained(folder)
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS] * 4)
    rc = main(["train", "--out", str(tmp_path / "run"), "--checkpoint.init_from", str(folder),
               "--data.path", str(chat), "--data.tokenizer", str(folder / "tokenizer.json"),
               "--data.cache_dir", str(tmp_path / "cache"), "--data.val_fraction", "0", "--train.seq_len", "64",
               "--train.global_batch", "4", "--train.micro_batch", "2", "--train.steps", "2",
               "--train.val_every", "0", "--checkpoint.every", "0", "--log.progress", "false",
               "--compute.device", "cpu", "--sample", ""])
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert rc == 0 and len(losses) == 2 and all(0 < x < 20 for x in losses)
