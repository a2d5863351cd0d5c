"""The copy of a rank's shards into host memory that a snapshot starts on the step path.

One buffer per rank, of exactly the bytes of its shards (raysft.checkpoint.memory.files lays them out; the file's
data is this buffer), allocated and, on a GPU, page-locked in the tier's thread, off the step path. Page-locked by
registering plain host memory with CUDA rather than through torch's pinned allocator, which rounds every
allocation up to a power of two (up to twice what `raysft plan` counts); registered with the rank's own device
current in that thread (a new thread's is device 0: under torchrun with every GPU visible, the rank's is another)
and as portable, so that the copy from the rank's device is a page-locked one.

On a GPU the step does not wait for the copy: it is queued on a side stream after the step's own work, and an
event marks its end. The tier's thread waits on that event before it writes the file; the next optimizer step,
which changes the weights and optimizer state in place, waits on it too, on the device (an optimizer step pre-hook),
so the forward and backward in between overlap the copy. On the CPU the copy is made on the spot (it must end
before the next update, and the host has no device to overlap it with).
"""

from __future__ import annotations

import torch

from raysft.checkpoint.memory.files import Slot, plan_slots, views

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context, not only the current one


class Stager:
    """The staging buffer and the copies into it, for one rank."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.slots: list[Slot] | None = None
        self.buffer: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None
        self._registered = False

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def fits(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether the buffer is laid out for `tensors` (the same names, dtypes and shapes)."""
        return self.slots is not None and self.slots == plan_slots(tensors)

    def allocate(self, tensors: dict[str, torch.Tensor]) -> None:
        """In the tier's thread: a buffer for `tensors` (the previous one released first)."""
        self.release()
        slots = plan_slots(tensors)
        buffer = torch.empty(slots[-1].end if slots else 0, dtype=torch.uint8)
        if self.cuda and buffer.numel():
            with torch.cuda.device(self.device):  # this thread's current device is 0, whatever this rank's is
                _check(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(),
                                                            HOST_REGISTER_PORTABLE), "cudaHostRegister")
            self._registered = True
        self.buffer, self.slots = buffer, slots

    def copy(self, tensors: dict[str, torch.Tensor]) -> None:
        """On the step path: start copying `tensors` (the buffer `fits` them) into the buffer."""
        targets = views(self.buffer, self.slots)
        if not self.cuda:
            for name, t in tensors.items():
                targets[name].copy_(t.detach())
            return
        compute = torch.cuda.current_stream()
        self.stream.wait_stream(compute)  # the step's own work first: the copy is of its result
        with torch.cuda.stream(self.stream):
            for name, t in tensors.items():
                if t.is_cuda:
                    t.record_stream(self.stream)
                targets[name].copy_(t.detach(), non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(self.stream)

    def small(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of a small device tensor (the metrics held), landed when the buffer's copy has (`landed`)."""
        if not self.cuda or not t.is_cuda:
            return t.detach().cpu().clone()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            t.record_stream(self.stream)
            out.copy_(t.detach(), non_blocking=True)
        return out

    def before_update(self) -> None:
        """The optimizer step waits, on the device, for the copy of the state it is about to change."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def landed(self) -> None:
        """In the tier's thread: wait until the copies have landed in host memory."""
        if self.event is not None:
            self.event.synchronize()

    def release(self) -> None:
        if self._registered:
            self.landed()
            with torch.cuda.device(self.device):
                _check(torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr()), "cudaHostUnregister")
            self._registered = False
        self.buffer, self.slots, self.event = None, None, None


def _check(result, call: str) -> None:
    code = result[0] if isinstance(result, tuple) else result
    if int(getattr(code, "value", code)) != 0:
        raise RuntimeError(f"{call} failed: CUDA error {code}")
