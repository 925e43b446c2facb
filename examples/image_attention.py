"""ImageLinearAttention as a drop-in layer of a small convolutional network, trained in seconds.

    python examples/image_attention.py                 # --steps 120 --batch-size 32 --lr 1e-2
    python examples/image_attention.py --no-attention  # the same network without the attention layer

The task needs information from two distant places of the image: every 16x16 image holds
two 3x3 marks, one in the left half and one in the right half, each bright (+1) or dark (-1),
on weak noise; the label says whether the two marks have the same sign. The network sees
the image through 3x3 convolutions and a global average at the end. Without a layer that mixes
positions, the average only counts bright and dark pixels, and "same" ({2 bright, 0 dark} or
{0, 2}) against "different" ({1, 1}) is not linearly separable from such counts (an XOR).
A residual ``ImageLinearAttention`` layer between the convolutions lets every position read
the whole image (q (kᵀ v) over the 256 pixels, never a 256 x 256 matrix) before the pointwise
non-linearity, so the network can learn the task.

Prints the training loss every ``--print-every`` steps and the loss and accuracy on a fixed
held-out set before and after training.
"""

from __future__ import annotations

import argparse
import os
import sys

# before torch loads OpenMP: idle threads sleep rather than spin (see train_enwik8.py)
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from linear_attention_transformer.images import ImageLinearAttention  # noqa: E402

SIZE, MARK = 16, 3


def make_batch(batch_size, generator):
    """(images (b, 1, 16, 16), labels (b,)): label 1 when the two marks have the same sign."""
    images = 0.1 * torch.randn(batch_size, 1, SIZE, SIZE, generator=generator)
    signs = torch.randint(0, 2, (batch_size, 2), generator=generator) * 2.0 - 1.0
    half = SIZE // 2
    rows = torch.randint(0, SIZE - MARK + 1, (batch_size, 2), generator=generator)
    cols = torch.randint(0, half - MARK + 1, (batch_size, 2), generator=generator)
    cols[:, 1] += half  # the second mark lies in the right half: the marks never overlap
    for i in range(batch_size):
        for m in range(2):
            r, c = rows[i, m].item(), cols[i, m].item()
            images[i, 0, r:r + MARK, c:c + MARK] += signs[i, m]
    return images, (signs[:, 0] == signs[:, 1]).long()


class AttentionConvNet(nn.Module):
    """conv 3x3 -> GELU -> residual ImageLinearAttention -> GELU -> conv 1x1 -> GELU -> mean -> 2 logits.

    Args: channels: width of the feature maps; heads, key_dim: of the attention layer;
        attention: False leaves the attention layer out (an ablation).
    Shapes: images (b, 1, H, W) -> logits (b, 2).
    """

    def __init__(self, channels=16, heads=4, key_dim=16, attention=True):
        super().__init__()
        self.stem = nn.Conv2d(1, channels, 3, padding=1)
        self.attn = ImageLinearAttention(chan=channels, heads=heads, key_dim=key_dim, value_dim=key_dim) if attention else None
        self.mix = nn.Conv2d(channels, channels, 1)
        self.head = nn.Linear(channels, 2)

    def forward(self, images):
        x = F.gelu(self.stem(images))
        if self.attn is not None:
            x = x + self.attn(x)  # every position reads the whole image
        x = F.gelu(x)
        x = F.gelu(self.mix(x)).mean(dim=(2, 3))
        return self.head(x)


@torch.no_grad()
def evaluate(model, images, labels):
    """(mean cross-entropy, accuracy) of ``model`` on a fixed set."""
    logits = model(images)
    return F.cross_entropy(logits, labels).item(), (logits.argmax(-1) == labels).float().mean().item()


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=120, help="training steps (Adam)")
    p.add_argument("--batch-size", type=int, default=32, help="fresh random images per step")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the initialisation and the training images; the held-out set is seed + 10000")
    p.add_argument("--print-every", type=int, default=20, help="print the mean training loss every N steps")
    p.add_argument("--no-attention", action="store_true",
                   help="ablation: the same network without the attention layer")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        raise SystemExit("--steps and --batch-size must be >= 1")

    torch.manual_seed(args.seed)
    data_rng = torch.Generator().manual_seed(args.seed)
    held_out = make_batch(512, torch.Generator().manual_seed(10_000 + args.seed))
    model = AttentionConvNet(attention=not args.no_attention)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    before = evaluate(model, *held_out)
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters; held-out loss {before[0]:.4f}, "
          f"accuracy {before[1]:.3f} before training")
    losses = []
    for step in range(1, args.steps + 1):
        images, labels = make_batch(args.batch_size, data_rng)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % args.print_every == 0 or step == args.steps:
            recent = losses[-args.print_every:]
            print(f"step {step:4d}  training loss {sum(recent) / len(recent):.4f}")
    after = evaluate(model, *held_out)
    print(f"held-out loss {after[0]:.4f}, accuracy {after[1]:.3f} after {args.steps} steps")
    return {"losses": losses, "held_out_before": before, "held_out_after": after}


if __name__ == "__main__":
    main()
    sys.exit(0)
