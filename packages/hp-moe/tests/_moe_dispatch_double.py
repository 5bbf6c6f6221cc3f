"""A test double of the torch_npu ops of hp-moe's NPU dispatchers, on CPU over gloo.

Adds to the token-op double (``_moe_npu_double.NpuMoeOpsDouble``) the four comm-fused ops:
``npu_alltoallv_gmm``, ``npu_gmm_alltoallv``, ``npu_moe_distribute_dispatch_v2`` and
``npu_moe_distribute_combine_v2``, with torch_npu's signatures (positional up to the counts or
``moe_expert_num``, keyword-only after), the checks the Ascend docs state (each failure a
``RuntimeError`` that starts with the op's name) and **real gloo communication** on the group
the ``hcom`` / ``group_ep`` name stands for (``comm_name``). Written from the docs,
independently of the package. The documented ranges (ep sizes, hidden sizes, dtypes) are
fields, so a test on 2 CPU ranks in float32 widens them; their defaults are the docs'.
Numbers in float32, results cast back to the input dtype; every call is recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from _moe_npu_double import Call, NpuMoeOpsDouble, _name
from torch import Tensor

HALF = (torch.float16, torch.bfloat16)


def _a2a(x: Tensor, send: list[int], recv: list[int], group: Any) -> Tensor:
    """Real all-to-all-v of the rows of ``x`` on ``group`` (gloo)."""
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def _blocks(n_src: int, e: int, counts: list[int]) -> list[list[tuple[int, int]]]:
    """(start, length) of block (s, le) of rows ordered s-major by ``counts[s·e + le]``."""
    out, start = [[(0, 0)] * e for _ in range(n_src)], 0
    for s in range(n_src):
        for le in range(e):
            out[s][le] = (start, counts[s * e + le])
            start += counts[s * e + le]
    return out


def _swap_major(x: Tensor, outer: int, inner: int, counts: list[int]) -> tuple[Tensor, Tensor]:
    """Rows in (outer, inner) blocks (``counts`` outer-major) reordered inner-major, and the
    index that did it."""
    b = _blocks(outer, inner, counts)
    idx = [
        i for le in range(inner) for s in range(outer) for i in range(b[s][le][0], sum(b[s][le]))
    ]
    index = torch.tensor(idx, dtype=torch.long)
    return x.index_select(0, index), index


@dataclass
class NpuDispatchOpsDouble(NpuMoeOpsDouble):
    """The token-op double plus the four comm-fused MoE ops (see the module docstring)."""

    soc: str | None = "Ascend910_9392"  # Atlas A3
    fused_ep_sizes: frozenset[int] = frozenset({8, 16, 32, 64, 128})
    fused_dtypes: tuple[torch.dtype, ...] = HALF
    dist_ep_range: tuple[int, int] = (2, 768)  # Atlas A3
    dist_hidden_range: tuple[int, int] = (1024, 8192)  # Atlas A3
    dist_max_bs: int = 512  # Atlas A3
    dist_dtypes: tuple[torch.dtype, ...] = HALF
    groups: dict[str, Any] = field(default_factory=dict)
    assists: dict[int, Any] = field(default_factory=dict)

    def soc_name(self) -> str | None:
        return self.soc

    def comm_name(self, group: Any) -> str:
        group = dist.group.WORLD if group is None else group
        name = f"hcom-moe-double-{dist.get_process_group_ranks(group)}"
        self.groups[name] = group
        return name

    def _group(self, op: str, hcom: str, ep: int) -> Any:
        group = self.groups.get(hcom)
        if group is None:
            raise RuntimeError(f"{op}: unknown communicator {hcom!r}")
        if dist.get_world_size(group) != ep:
            raise RuntimeError(f"{op}: ep_world_size={ep} but {hcom!r} has "
                               f"{dist.get_world_size(group)} ranks")  # fmt: skip
        return group

    def _record(self, op: str, tensors: list[Tensor], **kwargs: Any) -> None:
        self.calls.append(
            Call(op, tuple(tuple(t.shape) for t in tensors),
                 tuple(_name(t.dtype) for t in tensors), kwargs)
        )  # fmt: skip

    # --- npu_alltoallv_gmm / npu_gmm_alltoallv -------------------------------------------------

    def _fused_checks(
        self, op: str, x: Tensor, w: Tensor, hcom: str, ep: int, send: list[int],
        recv: list[int], trans: bool, rows_in: int,
    ) -> tuple[Any, int, Tensor]:  # fmt: skip
        def fail(msg: str) -> RuntimeError:
            return RuntimeError(f"{op}: {msg}")

        if ep not in self.fused_ep_sizes:
            raise fail(f"ep_world_size={ep} not in {sorted(self.fused_ep_sizes)}")
        if x.dtype not in self.fused_dtypes:
            raise fail(f"gmm_x must be float16 or bfloat16, got {_name(x.dtype)}")
        if w.dtype != x.dtype or w.dim() != 3 or x.dim() != 2:
            raise fail("gmm_x 2-D and gmm_weight 3-D of gmm_x's dtype")
        e = w.shape[0]
        if e > 32 or e * ep > 256:
            raise fail(f"e={e} local experts: e <= 32 and e*ep_world_size <= 256")
        if len(send) != e * ep or len(recv) != e * ep:
            raise fail(f"send_counts and recv_counts hold e*ep_world_size={e * ep} ints")
        if sum(send) != rows_in:
            raise fail(f"send_counts sum to {sum(send)} but gmm_x has {rows_in} rows")
        wt = w.transpose(1, 2) if trans else w  # [e, H1, N1]
        if wt.shape[1] != x.shape[1]:
            raise fail(f"H1 of gmm_x {tuple(x.shape)} and gmm_weight {tuple(w.shape)} differ")
        if not (0 < x.shape[1] < 65536 and 0 < wt.shape[2] < 65536):
            raise fail("H1 and N1 must be in (0, 65536)")
        return self._group(op, hcom, ep), e, wt

    @staticmethod
    def _gmm(x: Tensor, wt: Tensor, counts: list[int]) -> Tensor:
        out, start = [], 0
        for le, m in enumerate(counts):
            out.append(x[start : start + m].float() @ wt[le].float())
            start += m
        y = torch.cat(out) if out else x.new_zeros(0, wt.shape[2]).float()
        return y.to(x.dtype)

    def npu_alltoallv_gmm(
        self, gmm_x: Tensor, gmm_weight: Tensor, hcom: str, ep_world_size: int,
        send_counts: list[int], recv_counts: list[int], *, send_counts_tensor: Any = None,
        recv_counts_tensor: Any = None, mm_x: Any = None, mm_weight: Any = None,
        trans_gmm_weight: bool = False, trans_mm_weight: bool = False,
        permute_out_flag: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:  # fmt: skip
        op = "npu_alltoallv_gmm"
        self._record(op, [gmm_x, gmm_weight], send_counts=list(send_counts),
                     recv_counts=list(recv_counts), trans_gmm_weight=trans_gmm_weight,
                     permute_out_flag=permute_out_flag)  # fmt: skip
        if send_counts_tensor is not None or recv_counts_tensor is not None:
            raise RuntimeError(f"{op}: send/recv_counts_tensor are not supported yet")
        group, e, wt = self._fused_checks(op, gmm_x, gmm_weight, hcom, ep_world_size,
                                          send_counts, recv_counts, trans_gmm_weight,
                                          gmm_x.shape[0])  # fmt: skip
        ep = ep_world_size
        per_rank = lambda c: [sum(c[j * e : (j + 1) * e]) for j in range(ep)]  # noqa: E731
        with torch.no_grad():
            ata = _a2a(gmm_x, per_rank(send_counts), per_rank(recv_counts), group)
            permuted, _ = _swap_major(ata, ep, e, recv_counts)  # source-major -> expert-major
            by_expert = [sum(recv_counts[s * e + le] for s in range(ep)) for le in range(e)]
            y = self._gmm(permuted, wt, by_expert)
        return y, None, permuted if permute_out_flag else None

    def npu_gmm_alltoallv(
        self, gmm_x: Tensor, gmm_weight: Tensor, hcom: str, ep_world_size: int,
        send_counts: list[int], recv_counts: list[int], *, send_counts_tensor: Any = None,
        recv_counts_tensor: Any = None, mm_x: Any = None, mm_weight: Any = None,
        trans_gmm_weight: bool = False, trans_mm_weight: bool = False,
    ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        op = "npu_gmm_alltoallv"
        self._record(op, [gmm_x, gmm_weight], send_counts=list(send_counts),
                     recv_counts=list(recv_counts), trans_gmm_weight=trans_gmm_weight)  # fmt: skip
        if send_counts_tensor is not None or recv_counts_tensor is not None:
            raise RuntimeError(f"{op}: send/recv_counts_tensor are not supported yet")
        group, e, wt = self._fused_checks(op, gmm_x, gmm_weight, hcom, ep_world_size,
                                          send_counts, recv_counts, trans_gmm_weight,
                                          gmm_x.shape[0])  # fmt: skip
        ep = ep_world_size
        per_rank = lambda c: [sum(c[j * e : (j + 1) * e]) for j in range(ep)]  # noqa: E731
        with torch.no_grad():
            by_expert = [sum(send_counts[j * e + le] for j in range(ep)) for le in range(e)]
            y = self._gmm(gmm_x, wt, by_expert)  # expert-major rows (le, j)
            # unpermute: (le, j) blocks back to (j, le)
            le_major = [send_counts[j * e + le] for le in range(e) for j in range(ep)]
            back, _ = _swap_major(y, e, ep, le_major)
            out = _a2a(back, per_rank(send_counts), per_rank(recv_counts), group)
        return out, None

    # --- npu_moe_distribute_dispatch_v2 / combine_v2 -------------------------------------------

    def _dist_checks(self, op: str, x: Tensor, ids: Tensor, hcom: str, ep: int, rank: int,
                     experts: int, shared_expert_num: int) -> Any:  # fmt: skip
        def fail(msg: str) -> RuntimeError:
            return RuntimeError(f"{op}: {msg}")

        lo, hi = self.dist_ep_range
        if not lo <= ep <= hi:
            raise fail(f"ep_world_size={ep} outside [{lo}, {hi}]")
        if x.dtype not in self.dist_dtypes:
            raise fail(f"x must be bfloat16 or float16, got {_name(x.dtype)}")
        lo, hi = self.dist_hidden_range
        if not lo <= x.shape[1] <= hi:
            raise fail(f"H={x.shape[1]} outside [{lo}, {hi}]")
        if ids.dtype != torch.int32 or ids.dim() != 2 or x.dim() != 2:
            raise fail("x (expand_x) must be 2-D and expert_ids int32 [BS, K]")
        bs, k = ids.shape
        if not 0 < bs <= self.dist_max_bs:
            raise fail(f"BS={bs} outside (0, {self.dist_max_bs}]")
        if not 0 < k <= 16:
            raise fail(f"K={k} outside (0, 16]")
        if not 1 <= experts <= 1024 or experts % ep:
            raise fail(f"moe_expert_num={experts}: in [1, 1024] and a multiple of ep")
        if int(ids.min()) < 0 or int(ids.max()) >= experts:
            raise fail("expert_ids outside [0, moe_expert_num)")
        if any(len(set(row)) != len(row) for row in ids.tolist()):
            raise fail("the K expert ids of a row must differ")
        if shared_expert_num != 0:
            raise fail("the double implements shared_expert_num=0 only")
        if not 0 <= rank < ep:
            raise fail(f"ep_rank_id={rank} outside [0, {ep})")
        return self._group(op, hcom, ep)

    def npu_moe_distribute_dispatch_v2(
        self, x: Tensor, expert_ids: Tensor, group_ep: str, ep_world_size: int, ep_rank_id: int,
        moe_expert_num: int, *, scales: Any = None, x_active_mask: Any = None,
        expert_scales: Any = None, elastic_info: Any = None, group_tp: str = "",
        tp_world_size: int = 0, tp_rank_id: int = 0, expert_shard_type: int = 0,
        shared_expert_num: int = 1, shared_expert_rank_num: int = 0, quant_mode: int = 0,
        global_bs: int = 0, expert_token_nums_type: int = 1, comm_alg: str = "",
        zero_expert_num: int = 0, copy_expert_num: int = 0, const_expert_num: int = 0,
    ) -> tuple[Any, ...]:  # fmt: skip
        op = "npu_moe_distribute_dispatch_v2"
        self._record(op, [x, expert_ids], global_bs=global_bs,
                     shared_expert_num=shared_expert_num)  # fmt: skip
        group = self._dist_checks(op, x, expert_ids, group_ep, ep_world_size, ep_rank_id,
                                  moe_expert_num, shared_expert_num)  # fmt: skip
        if x.shape[0] != expert_ids.shape[0]:
            raise RuntimeError(f"{op}: x has {x.shape[0]} rows, expert_ids {expert_ids.shape[0]}")
        if quant_mode or scales is not None or tp_world_size > 1:
            raise RuntimeError(f"{op}: the double implements quant_mode=0 without TP only")
        ep, e = ep_world_size, moe_expert_num // ep_world_size
        bs, k = expert_ids.shape
        if global_bs and global_bs < bs * ep:
            raise RuntimeError(f"{op}: global_bs={global_bs} < BS*ep_world_size={bs * ep}")
        gbs = global_bs or bs * ep
        with torch.no_grad():
            flat = expert_ids.reshape(-1).long()
            order = torch.argsort(flat, stable=True)  # (token, slot) pairs sorted by expert
            rows = x.index_select(0, order // k)
            send = torch.bincount(flat, minlength=moe_expert_num).tolist()  # [ep * e]
            recv_t = torch.empty(ep * e, dtype=torch.int64)
            dist.all_to_all_single(recv_t, torch.tensor(send), group=group)  # counts: real too
            recv = recv_t.tolist()
            per_rank = lambda c: [sum(c[j * e : (j + 1) * e]) for j in range(ep)]  # noqa: E731
            ata = _a2a(rows, per_rank(send), per_rank(recv), group)
            expand, index = _swap_major(ata, ep, e, recv)
            a = gbs * min(e, k)
            padded = torch.cat([expand, expand.new_zeros(a - expand.shape[0], x.shape[1])])
        token_nums = torch.tensor(
            [sum(recv[s * e + le] for s in range(ep)) for le in range(e)], dtype=torch.int64
        )
        assist = {"order": order, "send": send, "recv": recv, "index": index, "e": e}
        key = torch.tensor([len(self.assists)], dtype=torch.int32)
        self.assists[int(key)] = assist
        ep_recv = torch.tensor(recv, dtype=torch.int32).cumsum(0).to(torch.int32)
        return padded, None, key, token_nums, ep_recv, None, None

    def npu_moe_distribute_combine_v2(
        self, expand_x: Tensor, expert_ids: Tensor, assist_info_for_combine: Tensor,
        ep_send_counts: Tensor, expert_scales: Tensor, group_ep: str, ep_world_size: int,
        ep_rank_id: int, moe_expert_num: int, *, tp_send_counts: Any = None,
        x_active_mask: Any = None, expand_scales: Any = None, shared_expert_x: Any = None,
        elastic_info: Any = None, ori_x: Any = None, const_expert_alpha_1: Any = None,
        const_expert_alpha_2: Any = None, const_expert_v: Any = None,
        performance_info: Any = None, group_tp: str = "", tp_world_size: int = 0,
        tp_rank_id: int = 0, expert_shard_type: int = 0, shared_expert_num: int = 1,
        shared_expert_rank_num: int = 0, global_bs: int = 0, comm_quant_mode: int = 0,
        comm_alg: str = "", zero_expert_num: int = 0, copy_expert_num: int = 0,
        const_expert_num: int = 0,
    ) -> Tensor:  # fmt: skip
        op = "npu_moe_distribute_combine_v2"
        self._record(op, [expand_x, expert_ids, expert_scales], global_bs=global_bs)
        group = self._dist_checks(op, expand_x, expert_ids, group_ep, ep_world_size,
                                  ep_rank_id, moe_expert_num, shared_expert_num)  # fmt: skip
        if expert_scales.dtype != torch.float32 or expert_scales.shape != expert_ids.shape:
            raise RuntimeError(f"{op}: expert_scales must be float32 [BS, K]")
        info = self.assists.pop(int(assist_info_for_combine))
        ep, e = ep_world_size, info["e"]
        bs, k = expert_ids.shape
        per_rank = lambda c: [sum(c[j * e : (j + 1) * e]) for j in range(ep)]  # noqa: E731
        with torch.no_grad():
            n = info["index"].numel()
            back = expand_x.new_empty(n, expand_x.shape[1])
            back[info["index"]] = expand_x[:n]  # expert-major -> source-major
            rows = _a2a(back, per_rank(info["recv"]), per_rank(info["send"]), group)
            slots = rows.new_zeros(bs * k, rows.shape[1])
            slots[info["order"]] = rows
            out = (slots.float().view(bs, k, -1) * expert_scales.unsqueeze(-1)).sum(1)
        return out.to(expand_x.dtype)
