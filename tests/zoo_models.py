"""The model zoo: tiny configs of models the project did not write, used unchanged.

Each entry builds a model (random init under a fixed seed, no downloads), a dataset of the
matching kind, and the loss of a batch, written the way each library's users write it. The
zoo test (tests/test_zoo.py) trains each under det_ddp at several world sizes and splits;
benchmarks/zoo_step.py times each step against plain training.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, CLASSES, IMAGE = 64, 8, 5, 8

__all__ = ["ZOO", "MORE", "ZooEntry", "make_data"]


@dataclass(frozen=True)
class ZooEntry:
    build: Callable[[], nn.Module]
    data: str  # "tokens", "images" or "vectors"
    loss: Callable[[nn.Module, tuple], torch.Tensor]


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    # default dropouts (0.1 on embeddings, attention and residuals)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2))


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=16,
                                               num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                               num_labels=CLASSES, hidden_dropout_prob=0.1))


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x if self.down is None else self.down(x)
        return self.relu(out)


class ResNet(nn.Module):
    """ResNet-18's structure at toy width: stem, basic blocks with in-place ReLU and residual +=."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True))
        self.layer1 = _BasicBlock(width, width, 1)
        self.layer2 = _BasicBlock(width, 2 * width, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, CLASSES)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class EncoderClassifier(nn.Module):
    """nn.TransformerEncoder as its users write it, dropout on."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens))[:, 0])


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, CLASSES))


def _lm_loss(model, batch):
    (tokens,) = batch
    return model(input_ids=tokens, labels=tokens).loss  # the library's own shifted loss


def _vit_loss(model, batch):
    images, labels = batch
    return model(pixel_values=images, labels=labels).loss


def _ce_loss(model, batch):
    x, labels = batch
    return F.cross_entropy(model(x), labels)


ZOO = {
    "gpt2": ZooEntry(_gpt2, "tokens", _lm_loss),
    "llama": ZooEntry(_llama, "tokens", _lm_loss),
    "vit": ZooEntry(_vit, "images", _vit_loss),
    "resnet": ZooEntry(ResNet, "images", _ce_loss),
    "encoder": ZooEntry(EncoderClassifier, "tokens_cls", _ce_loss),
    "mlp_dropout": ZooEntry(_mlp, "vectors", _ce_loss),
}


# ---- more library models, each for what it adds to the six above -------------------------------
def _hf(config: str, model: str, **kw) -> Callable[[], nn.Module]:
    def build():
        import transformers

        return getattr(transformers, model)(getattr(transformers, config)(**kw))

    return build


def _cls_loss(model, batch):
    tokens, labels = batch
    return model(input_ids=tokens, labels=labels).loss


def _embeds_loss(model, batch):
    images, labels = batch
    return F.cross_entropy(model(pixel_values=images).image_embeds, labels)


_TINY_LM = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=16)

MORE = {
    # token-type embeddings, a pooler with nn.Tanh, absolute positions broadcast over the batch
    "bert": ZooEntry(_hf("BertConfig", "BertForSequenceClassification", num_labels=CLASSES, **_TINY_LM),
                     "tokens_cls", _cls_loss),
    # position ids from a cumsum of the padding mask (integers), torch.tanh in the head
    "roberta": ZooEntry(_hf("RobertaConfig", "RobertaForSequenceClassification", num_labels=CLASSES,
                            **{**_TINY_LM, "max_position_embeddings": 20}), "tokens_cls", _cls_loss),
    # a sequence classifier: each row's last non-pad token picked by advanced indexing
    "gpt2_cls": ZooEntry(_hf("GPT2Config", "GPT2ForSequenceClassification", vocab_size=VOCAB, n_positions=16, n_embd=16,
                             n_layer=2, n_head=2, num_labels=CLASSES, pad_token_id=0), "tokens_cls", _cls_loss),
    # biased q/k/v projections, grouped-query heads
    "qwen2": ZooEntry(_hf("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=1, **_TINY_LM), "tokens", _lm_loss),
    # (1 + weight) RMSNorms, an embedding scaled by a buffer, tanh-GELU
    "gemma": ZooEntry(_hf("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=1, head_dim=8, **_TINY_LM),
                      "tokens", _lm_loss),
    # encoder-decoder, relative position bias, no attention scaling
    "t5": ZooEntry(_hf("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32,
                       num_layers=2, num_heads=2, decoder_start_token_id=0), "tokens", _lm_loss),
    # learned positions offset by 2, from a float cumsum of the attention mask; its dropouts at 0
    # (its decoder layers drop out a (batch * seq, D) view, which cannot be keyed per sample)
    "opt": ZooEntry(_hf("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=16, ffn_dim=32,
                        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=16, word_embed_proj_dim=16,
                        dropout=0.0), "tokens", _lm_loss),
    # encoder-decoder with learned positions offset by 2 and scaled word embeddings (dropouts at 0:
    # its layers drop out flattened views too)
    "bart": ZooEntry(_hf("BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB, d_model=16, encoder_layers=1,
                         decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                         decoder_ffn_dim=32, max_position_embeddings=16, dropout=0.0), "tokens", _lm_loss),
    # one layer's parameters shared by every layer, factorized embeddings
    "albert": ZooEntry(_hf("AlbertConfig", "AlbertForSequenceClassification", embedding_size=8, num_labels=CLASSES,
                           **_TINY_LM), "tokens_cls", _cls_loss),
    # ALiBi position biases (slopes from a power, added by baddbmm), fused qkv
    "bloom": ZooEntry(_hf("BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=16, n_layer=2, n_head=2),
                      "tokens", _lm_loss),
    # FalconLinear projections, parallel attention and MLP
    "falcon": ZooEntry(_hf("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                           num_attention_heads=2, max_position_embeddings=16), "tokens", _lm_loss),
    # channels-first LayerNorms, depthwise convolutions, layer scale, drop path, a global mean
    "convnext": ZooEntry(_hf("ConvNextConfig", "ConvNextForImageClassification", num_channels=3, patch_size=2,
                             num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], image_size=IMAGE, num_labels=CLASSES,
                             drop_path_rate=0.2), "images", _vit_loss),
    # inverted residuals: depthwise convolutions, BatchNorm, ReLU6
    "mobilenet_v2": ZooEntry(_hf("MobileNetV2Config", "MobileNetV2ForImageClassification", num_channels=3,
                                 image_size=IMAGE, depth_multiplier=0.25, num_labels=CLASSES), "images", _vit_loss),
    # CLIP's vision tower: QuickGELU, a class embedding, pre- and post-LayerNorms
    "clip_vision": ZooEntry(_hf("CLIPVisionConfig", "CLIPVisionModelWithProjection", image_size=IMAGE, patch_size=4,
                                hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                projection_dim=CLASSES), "images", _embeds_loss),
    # shifted-window attention with float masks, drop path, an AdaptiveAvgPool1d pooler
    "swin": ZooEntry(_hf("SwinConfig", "SwinForImageClassification", image_size=IMAGE, patch_size=2, num_channels=3,
                         embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=2, num_labels=CLASSES,
                         drop_path_rate=0.2), "images", _vit_loss),
}


def make_data(kind: str, n: int, seed: int = 7) -> torch.utils.data.TensorDataset:
    """``n`` samples of one kind, a function of the seed alone."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    if kind == "tokens":
        return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g))
    if kind == "tokens_cls":
        return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g), labels)
    if kind == "images":
        return torch.utils.data.TensorDataset(torch.randn(n, 3, IMAGE, IMAGE, generator=g), labels)
    if kind == "vectors":
        return torch.utils.data.TensorDataset(torch.randn(n, 12, generator=g), labels)
    raise ValueError(f"kind: expected 'tokens', 'tokens_cls', 'images' or 'vectors', got {kind!r}")
