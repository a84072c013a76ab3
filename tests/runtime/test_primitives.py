"""runtime/distributed/primitives.py in a real 2-rank gloo world, against hand-computed results."""

from dist import run_distributed


def _primitives_worker():
    import torch
    import torch.distributed as dist
    from torch import nn

    from modelcarve.runtime.distributed.primitives import (gather_cat, gather_flat, gather_parts, rank_piece,
                                                           reduce_scatter_tensor, slice_param)

    r = dist.get_rank()
    world = dist.group.WORLD
    out = {}
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]) + 10 * r  # rank 1: 11..16
    out["parts"] = [p.tolist() for p in gather_parts(x, world)]
    out["cat0"] = gather_cat(x, 0, world).tolist()
    out["cat1"] = gather_cat(x, 1, world).tolist()
    out["cat_last"] = gather_cat(x, -1, world).tolist()
    out["cat_noncontiguous"] = gather_cat(x.t(), 0, world).tolist()  # a transposed view is sent as it reads
    leaf = x.clone().requires_grad_(True)
    out["cat_grad"] = gather_cat(leaf, 0, world).requires_grad  # not an autograd function
    out["flat"] = gather_flat(torch.tensor([2.0 * r, 2.0 * r + 1]), world).tolist()
    alone = torch.tensor([7.0, 8.0])
    copy = gather_flat(alone, None)
    out["flat_none"] = copy.tolist()
    out["flat_none_own_storage"] = copy.data_ptr() != alone.data_ptr()
    wide = torch.arange(8.0).view(2, 4)
    piece = rank_piece(wide, 1, world)
    out["piece"], out["piece_contiguous"] = piece.tolist(), piece.is_contiguous()
    summed = torch.empty(2)
    reduce_scatter_tensor(summed, torch.tensor([1.0, 2.0, 3.0, 4.0]) * (r + 1), group=world)
    out["reduce_scatter"] = summed.tolist()

    lin = nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
    full = lin.weight
    slice_param(lin, "weight", 1, r, 2)
    with torch.no_grad():
        full.zero_()  # the piece has its own storage
    out["slice"] = lin.weight.tolist()
    out["slice_is_param"] = isinstance(lin.weight, nn.Parameter) and lin.weight.requires_grad
    frozen = nn.Linear(4, 2, bias=False).requires_grad_(False)
    with torch.no_grad():
        frozen.weight.copy_(torch.arange(8.0).view(2, 4))
    slice_param(frozen, "weight", 1, r, 2)  # an odd split of dim 1: torch.chunk's pieces
    out["frozen"] = (frozen.weight.tolist(), frozen.weight.requires_grad)
    return out


def test_primitives_two_ranks():
    results = run_distributed(_primitives_worker, 2, timeout=180)
    a = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    b = [[11.0, 12.0, 13.0], [14.0, 15.0, 16.0]]
    for r, got in enumerate(results):
        assert got["parts"] == [a, b]
        assert got["cat0"] == a + b
        assert got["cat1"] == [[1.0, 2.0, 3.0, 11.0, 12.0, 13.0], [4.0, 5.0, 6.0, 14.0, 15.0, 16.0]]
        assert got["cat_last"] == got["cat1"]
        assert got["cat_noncontiguous"] == [[1.0, 4.0], [2.0, 5.0], [3.0, 6.0], [11.0, 14.0], [12.0, 15.0], [13.0, 16.0]]
        assert got["cat_grad"] is False
        assert got["flat"] == [0.0, 1.0, 2.0, 3.0]
        assert got["flat_none"] == [7.0, 8.0] and got["flat_none_own_storage"]
        assert got["piece"] == ([[0.0, 1.0], [4.0, 5.0]] if r == 0 else [[2.0, 3.0], [6.0, 7.0]])
        assert got["piece_contiguous"]
        # rank 0 sends [1, 2 | 3, 4], rank 1 [2, 4 | 6, 8]: rank 0 keeps 1+2, 2+4, rank 1 3+6, 4+8
        assert got["reduce_scatter"] == ([3.0, 6.0] if r == 0 else [9.0, 12.0])
        assert got["slice"] == ([[1.0], [3.0], [5.0]] if r == 0 else [[2.0], [4.0], [6.0]])
        assert got["slice_is_param"]
        assert got["frozen"] == (([[0.0, 1.0], [4.0, 5.0]] if r == 0 else [[2.0, 3.0], [6.0, 7.0]]), False)
