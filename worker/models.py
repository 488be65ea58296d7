"""Models for the training job: small ones that train in minutes on 2 cores, larger ones for
throughput."""
from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """A perceptron with two hidden layers, for flat inputs (digits)."""

    def __init__(self, inputs: int = 64, classes: int = 10, hidden: int = 256):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(inputs, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of flattened inputs."""
        return self.net(x)


class SmallCNN(nn.Module):
    """For 8x8 digit images: two 3x3 convolutions, then two linear layers."""

    def __init__(self, channels: int = 1, classes: int = 10, side: int = 8):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * (side // 2) ** 2, 128), nn.ReLU(),
                                  nn.Linear(128, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of images."""
        return self.head(self.features(x))


class ConvNet(nn.Module):
    """Two blocks of convolution, batch norm, ReLU and 2x2 max-pooling, then two linear
    layers: the "2 conv + pooling + BN" family of Fashion-MNIST's benchmark table."""

    def __init__(self, channels: int = 1, classes: int = 10, side: int = 28, width: int = 32,
                 kernel: int = 5, hidden: int = 256):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, kernel, padding=kernel // 2), nn.BatchNorm2d(width),
            nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, kernel, padding=kernel // 2), nn.BatchNorm2d(2 * width),
            nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * (side // 4) ** 2, hidden),
                                  nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of images."""
        return self.head(self.features(x))


class BasicBlock(nn.Module):
    """ResNet's two-convolution residual block."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output: its convolutions plus the shortcut."""
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 inputs (CIFAR layout); ``width`` scales every stage."""

    def __init__(self, channels: int = 3, classes: int = 10, width: int = 64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
            layers += [BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of images."""
        out = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(out, 1), 1))


class VGG(nn.Module):
    """VGG-style for 32x32 inputs: a light convolutional stack, then large dense layers."""

    def __init__(self, channels: int = 3, classes: int = 10, width: int = 32, hidden: int = 2048):
        super().__init__()
        layers, cin = [], channels
        for cout in (width, "M", 2 * width, "M", 4 * width, 4 * width, "M"):
            if cout == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]
                cin = cout
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(cin * 16, hidden), nn.ReLU(),
                                        nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of images."""
        return self.classifier(self.features(x))


class TransformerLM(nn.Module):
    """A small causal Transformer language model over byte tokens."""

    def __init__(self, vocab: int = 256, dim: int = 128, heads: int = 4, layers: int = 2,
                 context: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(block, layers)
        self.out = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-byte logits at every position of a batch of byte sequences."""
        n = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:n]
        return self.out(self.blocks(h, mask=self.mask[:n, :n], is_causal=True))


MODELS = {"mlp": MLP, "cnn": SmallCNN, "convnet": ConvNet, "resnet18": ResNet18, "vgg": VGG, "transformer": TransformerLM}


def build(name: str, spec: dict) -> nn.Module:
    """The model named ``name`` built with ``spec``; an unknown name raises ``ValueError`` listing the valid ones."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid: {sorted(MODELS)}")
    return MODELS[name](**spec)
