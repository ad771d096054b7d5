"""KAPAO-architecture people / keypoint model (random weights, no downloads).

KAPAO (Keypoints And Poses As Objects) is a YOLOv5 detector whose classes are "person" plus one
"keypoint object" per body keypoint, and whose head also regresses, for every anchor, the
offsets of all keypoints.  KAPAO-L is built on YOLOv5l6: four output scales P3..P6 (strides
8/16/32/64), three anchors per scale, about 77M parameters.  The layer list below follows that
layout so that timings, activation sizes and the split points Intra-DP sees are those of the
real network; the weights are random, so the predictions are meaningless until real weights
are loaded.

Only Conv2d, BatchNorm2d, SiLU, MaxPool2d, Upsample(nearest) and torch.cat are used between the
input and the raw head maps, so that part traces with :mod:`torch.fx` and can be split
spatially.  The decoding step (:class:`Detect`) keeps KAPAO's lazily built grid cache, which is
shape-dependent state; :func:`symbolic_trace_kapao` traces it as one leaf module.

Layout of the outputs (``num_keypoints`` = K, default 17):

* per anchor ``no = 5 + (1 + K) + 2K`` channels: ``x, y, w, h`` (pixels), objectness,
  ``1 + K`` class scores (person, then one per keypoint), then ``K`` (x, y) keypoint positions
  in pixels.  For K = 17 that is 57.
* ``pred``: ``N x A x no`` with ``A = 3 * sum(H/s * W/s for s in 8, 16, 32, 64)``, scales in
  that order, and within a scale anchor-major, then row, then column (YOLOv5's order).
* ``raw``: list of the 4 undecoded head maps, each ``N x 3 x H/s x W/s x no`` (YOLOv5's layout).
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch
import torch.fx
from torch import nn

from robot_offload.tracing import ThisThreadTracer

__all__ = [
    "Conv",
    "Bottleneck",
    "C3",
    "SPPF",
    "Detect",
    "KAPAO",
    "build_kapao",
    "symbolic_trace_kapao",
    "KAPAO_ANCHORS",
    "KAPAO_STRIDES",
]

# KAPAO's anchors (pixels, w/h pairs) for the P6 models, per scale P3, P4, P5, P6.
KAPAO_ANCHORS: Tuple[Tuple[Tuple[float, float], ...], ...] = (
    ((19, 27), (44, 40), (38, 94)),
    ((96, 68), (86, 152), (180, 137)),
    ((140, 301), (303, 264), (238, 542)),
    ((436, 615), (739, 380), (925, 792)),
)
KAPAO_STRIDES: Tuple[int, ...] = (8, 16, 32, 64)
INPUT_MULTIPLE = 64  # the coarsest stride: every level must halve the previous one exactly


def _make_divisible(x: float, divisor: int = 8) -> int:
    """Round channel counts up to a multiple of 8, as YOLOv5 does, so scaled models stay GEMM-friendly."""
    return int(math.ceil(x / divisor) * divisor)


def _check_input(x: torch.Tensor) -> torch.Tensor:
    """Reject inputs whose sides are not multiples of 64 (the P6 stride).

    Otherwise the upsampled and lateral maps of the neck would disagree by one pixel and fail
    deep inside torch.cat with an unhelpful message.  Wrapped for torch.fx so it becomes one
    graph node instead of a data-dependent branch that tracing cannot follow.
    """
    if x.dim() != 4 or x.shape[1] != 3:
        raise ValueError(f"KAPAO expects an N x 3 x H x W tensor, got shape {tuple(x.shape)}")
    h, w = int(x.shape[2]), int(x.shape[3])
    if h % INPUT_MULTIPLE or w % INPUT_MULTIPLE or h == 0 or w == 0:
        raise ValueError(
            f"KAPAO input height and width must be positive multiples of {INPUT_MULTIPLE} "
            f"(the P6 stride), got {h}x{w}; resize or letterbox-pad the image first"
        )
    return x


torch.fx.wrap("_check_input")


class Conv(nn.Module):
    """Conv2d + BatchNorm2d + SiLU, YOLOv5's basic block ('same' padding for odd kernels)."""

    def __init__(self, c_in: int, c_out: int, k: int = 1, s: int = 1, p: int | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, k, s, k // 2 if p is None else p, bias=False)
        # YOLOv5's BN settings; they only matter for training but keep state_dicts comparable.
        self.bn = nn.BatchNorm2d(c_out, eps=1e-3, momentum=0.03)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    """1x1 then 3x3 Conv, with a residual add when shapes allow (backbone C3s only)."""

    def __init__(self, c_in: int, c_out: int, shortcut: bool = True) -> None:
        super().__init__()
        self.cv1 = Conv(c_in, c_out, 1)
        self.cv2 = Conv(c_out, c_out, 3)
        self.add = shortcut and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C3(nn.Module):
    """CSP block with 3 convs: half the channels go through n bottlenecks, half bypass them."""

    def __init__(self, c_in: int, c_out: int, n: int = 1, shortcut: bool = True) -> None:
        super().__init__()
        c_hidden = c_out // 2
        self.cv1 = Conv(c_in, c_hidden, 1)
        self.cv2 = Conv(c_in, c_hidden, 1)
        self.cv3 = Conv(2 * c_hidden, c_out, 1)
        self.m = nn.Sequential(*(Bottleneck(c_hidden, c_hidden, shortcut) for _ in range(n)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cv3(torch.cat([self.m(self.cv1(x)), self.cv2(x)], dim=1))


class SPPF(nn.Module):
    """Spatial pyramid pooling (fast): three chained 5x5 max-pools equal 5/9/13 pools in one pass."""

    def __init__(self, c_in: int, c_out: int, k: int = 5) -> None:
        super().__init__()
        c_hidden = c_in // 2
        self.cv1 = Conv(c_in, c_hidden, 1)
        self.cv2 = Conv(4 * c_hidden, c_out, 1)
        self.pool = nn.MaxPool2d(kernel_size=k, stride=1, padding=k // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.cv1(x)
        y1 = self.pool(x)
        y2 = self.pool(y1)
        y3 = self.pool(y2)
        return self.cv2(torch.cat([x, y1, y2, y3], dim=1))


class Detect(nn.Module):
    """Decodes the raw head maps into pixel boxes, scores and keypoints (YOLOv5 inference mode).

    Like YOLOv5/KAPAO's Detect, the cell grids and anchor grids are built the first time a
    feature size is seen and cached for later calls; so the first inference at a new input size
    does extra work that later ones skip, which is part of what a latency benchmark of the real
    model measures.  The cache is plain Python state (not buffers): it is not saved in the
    state_dict and is keyed by (height, width, device, dtype) so moving the model or changing
    the input size never reuses a stale grid.
    """

    def __init__(
        self,
        num_keypoints: int,
        anchors: Sequence[Sequence[Tuple[float, float]]] = KAPAO_ANCHORS,
        strides: Sequence[int] = KAPAO_STRIDES,
    ) -> None:
        super().__init__()
        self.num_keypoints = num_keypoints
        self.nc = 1 + num_keypoints  # person + one keypoint-object class per keypoint
        self.num_coords = 2 * num_keypoints
        self.no = 5 + self.nc + self.num_coords
        self.nl = len(strides)
        self.na = len(anchors[0])
        self.strides = tuple(int(s) for s in strides)
        # Anchors in pixels; a buffer so .to(device) moves it and real weights can overwrite it.
        self.register_buffer("anchors", torch.tensor(anchors, dtype=torch.float32), persistent=True)
        # One dict per scale: (ny, nx, device, dtype) -> (cell grid, anchor grid).
        self.grid_cache: List[Dict[tuple, Tuple[torch.Tensor, torch.Tensor]]] = [
            {} for _ in range(self.nl)
        ]

    def clear_grid_cache(self) -> None:
        """Forget all cached grids (e.g. to time a cold first inference again)."""
        for cache in self.grid_cache:
            cache.clear()

    def _grids(self, i: int, ny: int, nx: int, ref: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        key = (ny, nx, ref.device, ref.dtype)
        hit = self.grid_cache[i].get(key)
        if hit is not None:
            return hit
        yv, xv = torch.meshgrid(
            torch.arange(ny, device=ref.device, dtype=ref.dtype),
            torch.arange(nx, device=ref.device, dtype=ref.dtype),
            indexing="ij",
        )
        grid = torch.stack((xv, yv), dim=-1).view(1, 1, ny, nx, 2).expand(1, self.na, ny, nx, 2).contiguous()
        anchor_grid = (
            self.anchors[i].to(device=ref.device, dtype=ref.dtype)
            .view(1, self.na, 1, 1, 2)
            .expand(1, self.na, ny, nx, 2)
            .contiguous()
        )
        self.grid_cache[i][key] = (grid, anchor_grid)
        return grid, anchor_grid

    def forward(self, maps: List[torch.Tensor]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        decoded: List[torch.Tensor] = []
        raw: List[torch.Tensor] = []
        k = self.num_keypoints
        for i, m in enumerate(maps):
            bs, _, ny, nx = m.shape
            r = m.view(bs, self.na, self.no, ny, nx).permute(0, 1, 3, 4, 2).contiguous()
            raw.append(r)
            grid, anchor_grid = self._grids(i, ny, nx, r)
            stride = self.strides[i]
            y = r.sigmoid()
            xy = (y[..., 0:2] * 2.0 - 0.5 + grid) * stride
            wh = (y[..., 2:4] * 2.0) ** 2 * anchor_grid
            scores = y[..., 4 : 5 + self.nc]
            # Keypoints: offsets in [-2, 2] anchor sizes from the cell's top-left corner.
            kp = (y[..., 5 + self.nc :] * 4.0 - 2.0).view(bs, self.na, ny, nx, k, 2)
            kp = kp * anchor_grid.unsqueeze(-2) + (grid * stride).unsqueeze(-2)
            out = torch.cat([xy, wh, scores, kp.view(bs, self.na, ny, nx, self.num_coords)], dim=-1)
            decoded.append(out.view(bs, -1, self.no))
        return torch.cat(decoded, dim=1), raw


class KAPAO(nn.Module):
    """YOLOv5l6-layout backbone + PANet neck + 4-scale keypoint-object head + decoder.

    ``forward(x)`` takes ``N x 3 x H x W`` in [0, 1] (H, W multiples of 64) and returns
    ``(pred, raw)``; see the module docstring for the layouts.
    """

    def __init__(self, width_multiple: float = 1.0, depth_multiple: float = 1.0, num_keypoints: int = 17) -> None:
        super().__init__()
        if width_multiple <= 0 or depth_multiple <= 0:
            raise ValueError("width_multiple and depth_multiple must be positive")
        if num_keypoints < 1:
            raise ValueError("num_keypoints must be >= 1")

        def ch(c: int) -> int:
            return _make_divisible(c * width_multiple, 8)

        def n(k: int) -> int:
            return max(round(k * depth_multiple), 1)

        c64, c128, c256, c512, c768, c1024 = (ch(c) for c in (64, 128, 256, 512, 768, 1024))

        # Backbone (strides in comments).
        self.stem = Conv(3, c64, 6, 2, 2)  # /2
        self.down1 = Conv(c64, c128, 3, 2)  # /4
        self.c3_1 = C3(c128, c128, n(3))
        self.down2 = Conv(c128, c256, 3, 2)  # /8  -> P3
        self.c3_2 = C3(c256, c256, n(6))
        self.down3 = Conv(c256, c512, 3, 2)  # /16 -> P4
        self.c3_3 = C3(c512, c512, n(9))
        self.down4 = Conv(c512, c768, 3, 2)  # /32 -> P5
        self.c3_4 = C3(c768, c768, n(3))
        self.down5 = Conv(c768, c1024, 3, 2)  # /64 -> P6
        self.c3_5 = C3(c1024, c1024, n(3))
        self.sppf = SPPF(c1024, c1024, 5)

        # Neck, top-down path (FPN).
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.lat6 = Conv(c1024, c768, 1)
        self.td5 = C3(c768 + c768, c768, n(3), shortcut=False)
        self.lat5 = Conv(c768, c512, 1)
        self.td4 = C3(c512 + c512, c512, n(3), shortcut=False)
        self.lat4 = Conv(c512, c256, 1)
        self.out3 = C3(c256 + c256, c256, n(3), shortcut=False)  # P3 out
        # Bottom-up path (PAN).
        self.bu3 = Conv(c256, c256, 3, 2)
        self.out4 = C3(c256 + c256, c512, n(3), shortcut=False)  # P4 out
        self.bu4 = Conv(c512, c512, 3, 2)
        self.out5 = C3(c512 + c512, c768, n(3), shortcut=False)  # P5 out
        self.bu5 = Conv(c768, c768, 3, 2)
        self.out6 = C3(c768 + c768, c1024, n(3), shortcut=False)  # P6 out

        # Head: one 1x1 conv per scale, then decoding.
        self.detect = Detect(num_keypoints)
        self.head = nn.ModuleList(
            nn.Conv2d(c, self.detect.na * self.detect.no, 1) for c in (c256, c512, c768, c1024)
        )
        self._init_head_biases()

    def _init_head_biases(self) -> None:
        """YOLOv5's prior for random-init heads: few confident boxes per image, not half of them.

        Without it sigmoid(0)=0.5 objectness everywhere would make any downstream NMS stage
        behave (and cost) nothing like the trained model.
        """
        with torch.no_grad():
            for conv, s in zip(self.head, self.detect.strides):
                b = conv.bias.view(self.detect.na, self.detect.no)
                b[:, 4] += math.log(8 / (640 / s) ** 2)  # ~8 objects per 640x640 image
                b[:, 5 : 5 + self.detect.nc] += math.log(0.6 / (self.detect.nc - 0.99))

    @property
    def strides(self) -> Tuple[int, ...]:
        return self.detect.strides

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        x = _check_input(x)
        x = self.c3_1(self.down1(self.stem(x)))
        p3 = self.c3_2(self.down2(x))
        p4 = self.c3_3(self.down3(p3))
        p5 = self.c3_4(self.down4(p4))
        p6 = self.sppf(self.c3_5(self.down5(p5)))

        l6 = self.lat6(p6)
        l5 = self.lat5(self.td5(torch.cat([self.up(l6), p5], dim=1)))
        l4 = self.lat4(self.td4(torch.cat([self.up(l5), p4], dim=1)))
        o3 = self.out3(torch.cat([self.up(l4), p3], dim=1))
        o4 = self.out4(torch.cat([self.bu3(o3), l4], dim=1))
        o5 = self.out5(torch.cat([self.bu4(o4), l5], dim=1))
        o6 = self.out6(torch.cat([self.bu5(o5), l6], dim=1))

        maps = [conv(f) for conv, f in zip(self.head, (o3, o4, o5, o6))]
        return self.detect(maps)


def build_kapao(width_multiple: float = 1.0, depth_multiple: float = 1.0, num_keypoints: int = 17) -> nn.Module:
    """Build a randomly initialised KAPAO model in eval mode (BN uses its running statistics).

    Defaults give KAPAO-L (YOLOv5l6 layout, ~77M parameters).  Smaller multiples give
    proportionally thinner/shallower models with the same structure (e.g. 0.25/0.33 for tests).
    Seed torch's RNG beforehand for reproducible weights.
    """
    return KAPAO(width_multiple, depth_multiple, num_keypoints).eval()


class _KapaoTracer(ThisThreadTracer):
    """Keeps :class:`Detect` (shape-dependent grid cache) as one opaque call in the graph."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, Detect) or super().is_leaf_module(m, module_qualified_name)


def symbolic_trace_kapao(model: nn.Module) -> torch.fx.GraphModule:
    """torch.fx-trace a KAPAO model: every conv/BN/act/pool/upsample/cat becomes a node,
    while the decoder stays a single leaf call (its grid cache needs concrete shapes)."""
    graph = _KapaoTracer().trace(model)
    return torch.fx.GraphModule(model, graph, model.__class__.__name__)
