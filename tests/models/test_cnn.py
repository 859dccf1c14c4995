"""PixelCNN: reads pixel-token ids as grey levels in the image's layout, returns the Trainer's logit shape."""

import pytest
import torch

from linattn.models.cnn import PixelCNN


def test_reads_ids_as_grey_levels_row_by_row():
    model = PixelCNN(8, 3, width=2, offset=3)
    seen = []
    model.body[0].register_forward_hook(lambda mod, inp, out: seen.append(inp[0]))
    ids = torch.randint(0, 256, (2, 64)) + 3
    out = model(ids)
    assert out.shape == (2, 1, 3)
    assert torch.equal(seen[0], ((ids - 3).float() / 255).view(2, 1, 8, 8))
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_learns_a_spatial_rule():
    """A rule no bag of pixels can tell: one lit pixel in the left vs the right half."""
    torch.manual_seed(0)
    ids = torch.full((64, 64), 3)
    label = torch.arange(64) % 2
    col = torch.randint(0, 4, (64,)) + 4 * label
    ids[torch.arange(64), torch.randint(0, 8, (64,)) * 8 + col] = 3 + 255
    model = PixelCNN(8, 2, width=4)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    for _ in range(60):
        loss = torch.nn.functional.cross_entropy(model(ids)[:, 0], label)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    assert (model(ids)[:, 0].argmax(-1) == label).float().mean() > 0.95


def test_errors():
    with pytest.raises(ValueError, match="side"):
        PixelCNN(4, 2)
    with pytest.raises(ValueError, match="num_classes"):
        PixelCNN(32, 1)
    with pytest.raises(ValueError, match=r"input_ids must be \[B, 1024\]"):
        PixelCNN(32, 2)(torch.zeros(2, 1000, dtype=torch.long))
