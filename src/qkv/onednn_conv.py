"""1-D convolutions at inference on oneDNN, for VITS (``models/vits.py``): a (B, C, T) convolution
run as a 2-D one of height 1 on channels-last rows (:func:`conv_rows`), its weight re-laid out in
oneDNN's blocked format once per weight version (:func:`packed_weight`), and one oneDNN call that
also adds a residual or applies a leaky ReLU as it writes its output (:func:`conv_rows_fused`,
:func:`conv_frames`), where :func:`fusable` says the path may be taken (float32 on the CPU,
autograd not recording), and :func:`learn_layouts`, which learns the weight layouts of lengths
coming on a thread of its own. Two kinds of convolution skip oneDNN where it was measured slower:
stride-1 ones of one group as matrix products per tap (:func:`conv_taps`), depthwise ones as
multiply-adds per tap (:func:`conv_depthwise`).

Why a module of its own: it is how the convolutions run, not what the model is; every function
here equals PyTorch's plain convolution to float rounding (``tests/test_piper.py``). What is not
here: the model (``models/vits.py``), attention's kernels (``attention.py``).

Shapes: x (B, channels, T) or rows (B, channels, 1, T) channels-last; weight (out, in, k).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def conv_rows(conv: nn.Conv1d | nn.ConvTranspose1d, x: Tensor, scale: float = 1.0) -> Tensor:
    """``conv`` applied to a (B, channels, 1, samples) channels-last tensor as a 2-D convolution
    of height 1: the same numbers as the 1-D one, but oneDNN's channels-last kernels ran the
    generator's long convolutions faster on the CPU than its 1-D path in a micro-benchmark on 2
    cores (about 3× for the dilated ones, whose 1-D path is slowest; equal at short lengths).
    ``scale`` multiplies the weight (not the bias): the input's scale folded into the kernel."""
    weight = conv.weight.unsqueeze(2) * scale if scale != 1.0 else conv.weight.unsqueeze(2)  # (out, in, 1, k)
    if isinstance(conv, nn.ConvTranspose1d):  # weight (in, out, 1, k)
        return F.conv_transpose2d(x, weight, conv.bias, stride=(1, conv.stride[0]), padding=(0, conv.padding[0]))
    return F.conv2d(
        x, weight, conv.bias, padding=(0, conv.padding[0]), dilation=(1, conv.dilation[0]), groups=conv.groups
    )


def fusable(x: Tensor) -> bool:
    """Whether the generator may take its fused inference path on ``x``: oneDNN's convolutions
    with the residual sum (or a leaky ReLU) applied as they write their output, and sums in
    place. That needs a float32 CPU tensor and PyTorch's oneDNN fused-convolution operator (the
    one ``torch.compile``'s CPU backend calls), and autograd not recording ``x`` (a vocoder's
    adapter is trained through the frozen generator; its backward pass reads the tensors that
    in-place sums would overwrite)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
        and hasattr(torch.ops.mkldnn, "_convolution_pointwise_")
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


# packed copies kept per weight. The joe voice's convolutions got at most 3 layouts each on 2
# threads (the flow's 384×192 kernel-5: 2 alternating over 31-1,500 frames, a third at 30; the
# encoder's feed-forward: 3 over 10-400 phonemes; the generator's: at most 2 over 64-1,024 frames),
# so the bound drops none of them; it bounds what other shapes, CPUs and thread counts could keep
LAYOUTS_KEPT = 3
Geometry = tuple[tuple[int, int], tuple[int, int], tuple[int, int], int]  # padding, stride, dilation, groups


def _geometry(conv: nn.Conv1d | nn.ConvTranspose1d) -> Geometry:
    """``conv``'s padding, stride and dilation as a height-1 2-D convolution's, and its groups."""
    return (0, conv.padding[0]), (1, conv.stride[0]), (1, conv.dilation[0]), conv.groups


def phases(conv: nn.Conv1d | nn.ConvTranspose1d) -> int:
    """The stride of a transposed convolution :func:`polyphase` can run as a plain one (kernel =
    stride + 2·padding, as HiFi-GAN's upsamplings: the output is stride × the input's length), else 0."""
    if not isinstance(conv, nn.ConvTranspose1d) or conv.groups != 1 or conv.dilation != (1,):
        return 0
    fits = conv.output_padding == (0,) and conv.kernel_size[0] == conv.stride[0] + 2 * conv.padding[0]
    return conv.stride[0] if fits else 0


def _taps(kernel: int, stride: int) -> int:
    """K: the input frames one output frame of :func:`polyphase` reads (⌈kernel / stride⌉)."""
    return -(-kernel // stride)


def polyphase(weight: Tensor, bias: Tensor | None, stride: int, padding: int) -> tuple[Tensor, Tensor | None, int]:
    """A transposed convolution (kernel k = stride + 2·padding) as a plain one with ``stride``
    times the output channels, one set per phase. Output sample n = t·s + q is
    Σ_e x[t − e] · W[:, :, e·s + q + p]; its taps are ρ = (q + p) mod s, ρ + s, ... < k, and they
    read the K = ⌈k / s⌉ frames up to u = t + ⌊(q + p) / s⌋, so a kernel-K convolution with
    padding K − 1 (output frames u = 0..T + K − 2) computes every phase with no tap that is
    always zero (HiFi-GAN's k = 2s: 2 taps a phase, where one window of frames around t for
    every phase took 3). With the phases of frame u in the order q = s − r, ..., s − 1, 0, ...,
    s − r − 1 (r = p mod s), frame u holds samples u·s − p .. u·s − p + s − 1: channels-last, its
    output (B, T + K − 1, s, out) in memory is the waveform (B, samples, out) from sample p on.
    Why: oneDNN's transposed convolution made for a new length cost more than a plain one (35-50
    ms of one thread at 13,056 frames, against 3 ms for the convolution itself, measured on 2 busy
    cores), and the 2-tap form took about 30% less CPU than the 3-tap one at the joe voice's three
    upsamplings (1 thread, best of 30, contended machine).
    Shapes: weight (in, out, k), bias (out,) -> weight (s·out, in, K), bias (s·out,), K."""
    n_in, n_out, k = weight.shape
    taps = _taps(k, stride)
    order = (torch.arange(stride, device=weight.device) + stride - padding % stride) % stride  # q by memory slot
    first = (order + padding) % stride  # ρ: each phase's first tap
    index = torch.arange(taps - 1, -1, -1, device=weight.device)[:, None] * stride + first[None, :]  # (K, s)
    picked = weight[:, :, index.clamp(max=k - 1)] * (index < k)  # (in, out, K, s)
    phased = picked.permute(3, 1, 0, 2).reshape(stride * n_out, n_in, taps)  # (s·out, in, K)
    return phased, None if bias is None else bias.repeat(stride), taps


def _run_shape(conv: nn.Conv1d | nn.ConvTranspose1d) -> tuple[bool, tuple[int, ...], Geometry]:
    """What :func:`_run_form` gives oneDNN, without the weight: whether transposed, the weight's
    shape as (out, in, 1, k) (transposed: (in, out, 1, k)) and the geometry."""
    stride = phases(conv)
    if stride:
        n_in, n_out, _ = conv.weight.shape
        taps = _taps(conv.kernel_size[0], stride)
        return False, (stride * n_out, n_in, 1, taps), ((0, taps - 1), (1, 1), (1, 1), 1)
    n_out, n_in, k = conv.weight.shape
    return isinstance(conv, nn.ConvTranspose1d), (n_out, n_in, 1, k), _geometry(conv)


def _run_form(conv: nn.Conv1d | nn.ConvTranspose1d, scale: float) -> tuple[Tensor, Tensor | None, bool, Geometry]:
    """What oneDNN runs for ``conv``: the weight times ``scale`` as (out, in, 1, k) (transposed:
    (in, out, 1, k)), the bias, whether transposed, and the geometry; a :func:`polyphase`
    transposed convolution as its plain one."""
    weight, bias = conv.weight.detach() * scale if scale != 1.0 else conv.weight.detach(), conv.bias
    transposed, _, geometry = _run_shape(conv)
    stride = phases(conv)
    if stride:
        weight, bias, _ = polyphase(weight, None if bias is None else bias.detach(), stride, conv.padding[0])
    return weight.unsqueeze(2), bias, transposed, geometry


def _pack(weight: Tensor, transposed: bool, geometry: Geometry, input_size: tuple[int, ...]) -> Tensor:
    """``weight`` (out, in, 1, k) (transposed: (in, out, 1, k)) re-laid out in the blocked format
    oneDNN's convolution picks for an input of ``input_size`` (B, in, 1, samples)."""
    padding, stride, dilation, groups = geometry
    ops = torch.ops.mkldnn
    if transposed:
        return ops._reorder_convolution_transpose_weight(weight, padding, (0, 0), stride, dilation, groups, input_size)
    return ops._reorder_convolution_weight(weight, padding, stride, dilation, groups, input_size)


@functools.lru_cache(maxsize=4096)
def _weight_format(
    transposed: bool, shape: tuple[int, ...], geometry: Geometry, input_size: tuple[int, ...], threads: int
) -> bytes:
    """oneDNN's memory descriptor (its serialised bytes) of the blocked weight its convolution of
    this geometry picks for this input size and thread count, learnt by packing zeros once. The
    pick follows the length: for the flow's 384×192 kernel-5 convolutions, 32 output channels a
    block at 300 frames, 24 at 204, 16 at 52,224 (oneDNN's verbose log), and a weight packed for
    another length is re-laid out again at every call (a generic reorder: 32 ms of CPU time for a
    2.7 ms convolution at 204 frames, measured on 2 busy cores). ``threads`` is in the key as the
    pick balances the work over them."""
    del threads  # part of the key only
    packed = _pack(torch.zeros(shape), transposed, geometry, input_size)
    # from byte 112 on: the padded dimensions, offsets and blocking. Before them: the dimensions
    # (``shape``, in the key) and the data type, then 4 bytes of alignment padding that hold
    # whatever was there (they differed between packs of one layout at each other length)
    return torch.ops.mkldnn._get_mkldnn_serialized_md(packed)[112:].numpy().tobytes()


@functools.cache
def _learner() -> ThreadPoolExecutor:
    """The one thread :func:`learn_layouts` runs on (made at its first use)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="qkv-onednn-layouts")


def learn_layouts(jobs: Sequence[tuple[nn.Conv1d | nn.ConvTranspose1d, tuple[int, ...]]]) -> Future:
    """oneDNN's weight layouts (:func:`_weight_format`) for each (convolution, input size) of
    ``jobs``, learnt on a thread of their own while the caller goes on: a caller that knows the
    lengths coming (the generator's, once the durations are known) has them learnt while it runs
    something else (the flow), each a oneDNN convolution set up on zeros, about 1.7 ms of CPU for
    each of the joe voice's generator convolutions at a new length (2 busy cores). oneDNN
    releases Python's lock while it works. A layout asked for before its job is done is learnt
    again by the asker (the same bytes: the cache keeps one). The thread runs with the caller's
    thread count, which oneDNN's pick depends on."""
    threads = torch.get_num_threads()

    def learn() -> None:
        torch.set_num_threads(threads)  # the same count: sets this thread's OpenMP count to it
        for conv, input_size in jobs:
            transposed, shape, geometry = _run_shape(conv)
            _weight_format(transposed, shape, geometry, tuple(input_size), threads)

    return _learner().submit(learn)


def _kept(conv: nn.Module, name: str, key: tuple, make):
    """What ``make()`` returns, kept on ``conv`` under ``name`` (a plain attribute: neither
    parameter nor buffer) while ``key`` (the weight's storage and version, and whatever else the
    value depends on) is unchanged, made again when it changes."""
    kept = conv.__dict__.get(name)
    if kept is None or kept[0] != key:
        kept = conv.__dict__[name] = (key, make())
    return kept[1]


def packed_weight(
    conv: nn.Conv1d | nn.ConvTranspose1d, input_size: tuple[int, ...], scale: float = 1.0
) -> tuple[Tensor, Tensor | None]:
    """``conv``'s weight times ``scale`` as oneDNN runs it (:func:`_run_form`) in oneDNN's own
    blocked layout for an input of ``input_size`` (B, in, 1, samples), and the bias it runs
    with: made at the first call needing that layout and kept on the module while the weight is
    unchanged (same storage and version), one copy per layout (:func:`_weight_format`), the
    :data:`LAYOUTS_KEPT` used last. Given a weight in another layout, oneDNN re-lays it out at
    every call: a parallel pass of its own, which on a loaded machine waited for a core about as
    long as a long convolution took. The bound: unbounded, each weight could be kept once per
    layout oneDNN ever picked for it (a medium voice's packed convolutions hold about 50 MB a
    copy); a length whose layout was dropped packs it again (one re-layout, as at its first call)."""
    weight, bias = conv.weight, conv.bias
    key = (weight.data_ptr(), weight._version, scale, None if bias is None else (bias.data_ptr(), bias._version))
    (run, bias, transposed, geometry), packs = _kept(
        conv, "_packed_weights", key, lambda: (_run_form(conv, scale), OrderedDict())
    )
    layout = _weight_format(transposed, tuple(run.shape), geometry, tuple(input_size), torch.get_num_threads())
    if layout in packs:
        packs.move_to_end(layout)  # the most recently used last
    else:
        packs[layout] = _pack(run, transposed, geometry, tuple(input_size))
        while len(packs) > LAYOUTS_KEPT:
            packs.popitem(last=False)  # the least recently used
    return packs[layout], bias


def conv_rows_fused(
    conv: nn.Conv1d | nn.ConvTranspose1d,
    x: Tensor,
    scale: float = 1.0,
    *,
    residual: Tensor | None = None,
    in_place: bool = False,
    slope: float | None = None,
) -> Tensor:
    """:func:`conv_rows` in one oneDNN call on the :func:`packed_weight`, which also adds
    ``residual`` to the output (into ``residual`` itself when ``in_place``) or applies a leaky
    ReLU of ``slope`` to it: each saves a pass over a waveform-sized tensor. A transposed
    convolution takes no residual; where :func:`phases` allows, it runs as its :func:`polyphase`
    plain convolution. Only where :func:`fusable`. Shapes: x, residual (B, channels, 1, samples)
    channels-last -> the same (transposed: samples × stride)."""
    weight, bias = packed_weight(conv, tuple(x.shape), scale)
    ops, unary = torch.ops.mkldnn, ("none", [], "") if slope is None else ("leaky_relu", [slope], "")
    stride = phases(conv)
    if stride:
        taps, padding, t = weight.shape[-1], conv.padding[0], x.shape[-1]
        y = ops._convolution_pointwise(x, weight, bias, (0, taps - 1), (1, 1), (1, 1), 1, *unary)  # (B, s·out, 1, U)
        # (B, U, s, out) in memory is the waveform (B, samples, out) from sample p on (polyphase)
        samples = y.permute(0, 2, 3, 1).reshape(y.shape[0], 1, -1, y.shape[1] // stride)  # (B, 1, U·s, out)
        out = samples[:, :, padding : padding + t * stride].permute(0, 3, 1, 2)  # (B, out, 1, T·s)
        # one sentence: a view (channels-last, offset); several: a batch stride oneDNN reads densely
        return out if out.shape[0] == 1 else out.contiguous(memory_format=torch.channels_last)
    geometry = _geometry(conv)
    if isinstance(conv, nn.ConvTranspose1d):
        return ops._convolution_transpose_pointwise(x, weight, bias, geometry[0], (0, 0), *geometry[1:], *unary)
    if residual is None:
        return ops._convolution_pointwise(x, weight, bias, *geometry, *unary)
    if in_place:
        return ops._convolution_pointwise_(residual, x, weight, bias, *geometry, "add", 1.0, None, [], None)
    return ops._convolution_pointwise(x, residual, weight, bias, *geometry, "add", 1.0, None, [], None)


def tap_weights(conv: nn.Conv1d) -> Tensor:
    """``conv``'s weight as one (in, out) matrix per tap, kept on the module while the weight is
    unchanged (same storage and version), as :func:`packed_weight` keeps its copies.
    Shapes: weight (out, in, k) -> (k, in, out)."""
    weight = conv.weight
    key = (weight.data_ptr(), weight._version)
    return _kept(conv, "_tap_weights", key, lambda: weight.detach().permute(2, 1, 0).contiguous())


def conv_taps(conv: nn.Conv1d, x: Tensor) -> Tensor:
    """``conv(x)`` for a stride-1 convolution of one group, as one matrix product per tap on the
    frames in memory order: out[t] = bias + Σ_j x[t + j·d − p] · W_j over the frames inside,
    each product added into its rows of the output in place (no padded copy of ``x``). Why: on
    the voices' shapes it took less CPU than oneDNN's convolution of the same weights (the flow's
    192→384 kernel-5 at 300 frames: 3.0 against 3.6 ms on 1 thread, 3.4 against 3.8 ms on 2,
    best of 40, contended machine; the generator's 192→256 kernel-7 alike), and a new length
    makes no oneDNN convolution. Zero padding only (``padding_mode`` "zeros").
    Shapes: x (B, in, T) -> (B, out, T'), (B, T', out) in memory."""
    b, _, t = x.shape
    (k,), (d,), (p,) = conv.kernel_size, conv.dilation, conv.padding
    frames = t + 2 * p - d * (k - 1)
    rows = x.transpose(1, 2).contiguous()  # (B, T, in): no copy if x is channels-last
    taps = tap_weights(conv)  # (k, in, out)
    out = x.new_empty(b, frames, conv.out_channels)  # (B, T', out)
    if conv.bias is None:
        out.zero_()
    else:
        out.copy_(conv.bias.detach().expand_as(out))
    for j in range(k):
        shift = j * d - p  # out[t] reads x[t + shift]
        lo, hi = max(0, -shift), min(frames, t - shift)
        for i in range(b if lo < hi else 0):
            out[i, lo:hi].addmm_(rows[i, lo + shift : hi + shift], taps[j])  # (T'', in) @ (in, out)
    return out.transpose(1, 2)  # (B, out, T')


def depthwise(conv: nn.Conv1d) -> bool:
    """Whether ``conv`` is a stride-1 depthwise convolution (one group per channel, in = out
    channels, zero padding): what :func:`conv_depthwise` runs."""
    return (
        conv.groups == conv.in_channels == conv.out_channels
        and conv.stride == (1,)
        and conv.padding_mode == "zeros"
        and isinstance(conv.padding, tuple)
    )


def conv_depthwise(conv: nn.Conv1d, x: Tensor) -> Tensor:
    """``conv(x)`` for a :func:`depthwise` convolution as one multiply-add per tap over the
    frames inside: out[c, t] = bias[c] + Σ_j W[c, j] · x[c, t + j·d − p]. Why: the duration
    predictor's depthwise convolutions (192 channels, kernel 3, a sentence's phonemes) are a few
    thousand multiply-adds each, and oneDNN's call cost more than that before it ran: about
    100-250 µs of the calling thread per call at 8 phonemes (its primitive descriptor is made
    at every call; 1 and 2 threads, contended), 12 calls a sentence.
    Shapes: x (B, channels, T) -> (B, channels, T'), (B, T', channels) in memory."""
    b, c, t = x.shape
    (k,), (d,), (p,) = conv.kernel_size, conv.dilation, conv.padding
    frames = t + 2 * p - d * (k - 1)
    weight = conv.weight.detach()[:, 0, :, None]  # (channels, k, 1)
    out = x.new_empty(b, frames, c).transpose(1, 2)  # (B, channels, T'): channels-last, as conv_frames gives
    if conv.bias is None:
        out.zero_()
    else:
        out.copy_(conv.bias.detach()[:, None].expand_as(out))
    for j in range(k):
        shift = j * d - p  # out[t] reads x[t + shift]
        lo, hi = max(0, -shift), min(frames, t - shift)
        if lo < hi:
            out[..., lo:hi].addcmul_(x[..., lo + shift : hi + shift], weight[:, j])
    return out


def conv_frames(conv: nn.Conv1d, x: Tensor, *, taps: bool = False) -> Tensor:
    """``conv(x)``, where :func:`fusable`, as one oneDNN call on the :func:`packed_weight` with
    ``x`` seen as channels-last rows (:func:`conv_rows`). The plain 1-D call converted the
    layouts every time: the input to oneDNN's blocked layout, the weight, the output back (about
    3 conversions per convolution, measured with oneDNN's verbose log). The output comes back
    channels-last, (B, T, channels) in memory, which the next convolution, the channel norms and
    the element-wise steps read as it is. A kernel-1 convolution is a matrix product over the
    channels instead: oneDNN's 1×1 kernels want their weight blocked by the length, so one packed
    weight was re-laid out again at each other length (2.7 ms a call for 384×192 at 400 frames).
    With ``taps``, a wider stride-1 convolution of one group is :func:`conv_taps`' matrix
    products instead (the flow's and the generator's first: measured faster there; the text
    encoder's feed-forward at phoneme lengths took more CPU that way in the whole voice on 2
    threads, 4 runs of 4, contended, so it stays one oneDNN call). A :func:`depthwise` convolution
    is always :func:`conv_depthwise`'s multiply-adds.
    Shapes: x (B, channels, T) -> (B, out_channels, T')."""
    if not fusable(x) or (torch.is_grad_enabled() and conv.weight.requires_grad):  # oneDNN's op records nothing
        return conv(x)
    if conv.kernel_size == (1,) and conv.groups == 1 and conv.padding == (0,) and conv.stride == (1,):
        return F.linear(x.transpose(1, 2), conv.weight[:, :, 0], conv.bias).transpose(1, 2)  # (B, out_channels, T)
    if depthwise(conv):
        return conv_depthwise(conv, x)  # (B, out_channels, T')
    plain = conv.groups == 1 and conv.stride == (1,) and conv.padding_mode == "zeros"
    if taps and plain and isinstance(conv.padding, tuple):
        return conv_taps(conv, x)  # (B, out_channels, T')
    rows = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)  # (B, channels, 1, T): no copy if it was
    return conv_rows_fused(conv, rows).squeeze(2)  # (B, out_channels, T')
