"""The optional transformers-based diagnoser runs on a local model (random weights, no download)."""

import pytest

from jaxsys.cluster.diagnosis import KINDS, ModelDiagnoser, diagnose


def test_model_diagnoser_with_local_tiny_classifier(tmp_path):
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("torch")
  words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "error", "cuda", "nccl", "memory", "out",
           "of", "key", "module", "no", "named", "timeout", "step", "loss"]
  (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
  tok = transformers.BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt"))
  labels = [k for k in KINDS if k != "unknown"]
  cfg = transformers.BertConfig(vocab_size=len(words), hidden_size=16, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=32, max_position_embeddings=64,
                                num_labels=len(labels), id2label=dict(enumerate(labels)),
                                label2id={k: i for i, k in enumerate(labels)})
  transformers.BertForSequenceClassification(cfg).save_pretrained(tmp_path)
  tok.save_pretrained(tmp_path)
  model = ModelDiagnoser(str(tmp_path), mode="classify")
  d = model("step 3 loss nan\nsomething odd happened")
  assert d.source == "model" and d.kind in KINDS
  # Rules decide what they recognise; the model only gets the logs the rules call unknown.
  assert diagnose("KeyError: 'x'", model=model).source == "rules"
  assert diagnose("mysterious silence", model=model).source == "model"
