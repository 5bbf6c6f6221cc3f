"""Layout algebra without processes: slices, flatten/unflatten round trips, rank sets."""

import itertools
import math

import pytest

from hyper_parallel.dtensor.layout import Layout, LayoutError

SHAPES = [(2,), (8,), (2, 4), (4, 2), (2, 2, 2), (3, 2, 2), (2, 3, 4), (6, 2)]


def _partition_ok(groups, n):
    flat = sorted(itertools.chain.from_iterable(groups))
    return flat == list(range(n))


@pytest.mark.parametrize("shape", SHAPES)
def test_root_instance_is_row_major_mesh(shape):
    root = Layout.root(shape)
    n = math.prod(shape)
    assert root.instance_bases() == [0]
    flat = list(itertools.chain.from_iterable(_flat(root.instance_ranks(0))))
    assert flat == list(range(n))


def _flat(x):
    if isinstance(x, list):
        for i in x:
            yield from _flat(i)
    else:
        yield [x]


@pytest.mark.parametrize("shape", SHAPES)
def test_every_dim_rank_sets_partition_the_root(shape):
    root = Layout.root(shape)
    n = math.prod(shape)
    for d in range(len(shape)):
        groups = root.dim_groups(d)
        assert _partition_ok(groups, n)
        assert all(len(g) == shape[d] for g in groups)
        # stride arithmetic: consecutive members differ by the row-major stride of d
        stride = math.prod(shape[d + 1 :])
        assert all(b - a == stride for g in groups for a, b in zip(g, g[1:]))


@pytest.mark.parametrize("shape", SHAPES)
def test_flatten_then_unflatten_is_identity(shape):
    root = Layout.root(shape)
    assert root.flatten().unflatten(0, shape) == root
    for d in range(len(shape)):
        assert root.unflatten(d, (shape[d],)) == root


@pytest.mark.parametrize("shape", SHAPES)
def test_unflatten_then_flatten_is_identity(shape):
    root = Layout.root(shape)
    for d, size in enumerate(shape):
        for a in range(1, size + 1):
            if size % a:
                continue
            split = root.unflatten(d, (a, size // a))
            assert split.flatten([d, d + 1]) == root
            assert split.shape == shape[:d] + (a, size // a) + shape[d + 1 :]


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 3, 4), (4, 2, 2)])
def test_noncontiguous_submesh_slice_and_flatten(shape):
    """Slicing outer and inner dims of a 3-D root gives a non-contiguous submesh; its
    instances tile the root and flatten/unflatten round-trip on it."""
    root = Layout.root(shape)
    sub = root.slice([0, 2])
    n = math.prod(shape)
    bases = sub.instance_bases()
    assert len(bases) == shape[1]
    assert _partition_ok([sub.instance_slots(b) for b in bases], n)
    flat = sub.flatten()
    assert flat.shape == (shape[0] * shape[2],)
    assert flat.unflatten(0, (shape[0], shape[2])) == sub
    # the flattened rank sets equal the row-major enumeration of each instance
    for b in bases:
        assert tuple(root.rank_map[s] for s in sub.instance_slots(b)) in flat.dim_groups(0)


def test_docstring_example_sibling_groups():
    root = Layout.root((4, 2))
    cp = root.slice([0])
    assert cp.instance_ranks(0) == [0, 2, 4, 6]
    assert cp.instance_ranks(3) == [1, 3, 5, 7]
    sub = cp.unflatten(0, (2, 2))
    assert sub.offsets == ((0, 4), (0, 2))
    assert sub.dim_groups(1) == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert sub.dim_groups(0) == [(0, 4), (2, 6), (1, 5), (3, 7)]
    assert sub.instance_ranks(5) == [[1, 3], [5, 7]]
    assert sub.group_of(1, 6) == (4, 6)


def test_rank_map_is_respected():
    root = Layout.root((2, 2), rank_map=[3, 1, 0, 2])
    assert root.instance_ranks(0) == [[3, 1], [0, 2]]
    assert root.dim_groups(0) == [(3, 0), (1, 2)]


@pytest.mark.parametrize("shape", [(2, 4), (2, 2, 2), (3, 2, 2)])
def test_of_instance_recovers_layout(shape):
    root = Layout.root(shape)
    for dims in itertools.chain.from_iterable(
        itertools.permutations(range(len(shape)), k) for k in range(1, len(shape) + 1)
    ):
        sub = root.slice(dims)
        for base in sub.instance_bases():
            ranks = sub.instance_ranks(root.rank_map[base])
            assert Layout.of_instance(root.rank_map, ranks) == sub


def test_unflatten_misaligned_split_is_rejected():
    # dim offsets (0,1,2,8,9,10) come from a (2, 3) split; a (3, 2) split does not align
    layout = Layout(((0, 1, 2, 8, 9, 10),), tuple(range(16)))
    with pytest.raises(LayoutError, match="does not align"):
        layout.unflatten(0, (3, 2))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda L: L.unflatten(0, (3, 2)), "multiply to 6"),
        (lambda L: L.unflatten(0, (0, 4)), "positive"),
        (lambda L: L.unflatten(2, (2,)), "out of range"),
        (lambda L: L.slice([0, 0]), "distinct"),
        (lambda L: L.slice([-1]), "out of range"),
    ],
)
def test_bad_layout_operations_raise(call, message):
    with pytest.raises(LayoutError, match=message):
        call(Layout.root((4, 2)))


def test_bad_roots_raise():
    with pytest.raises(LayoutError):
        Layout.root((2, 0))
    with pytest.raises(LayoutError):
        Layout.root((2, 2), rank_map=[0, 1, 1, 2])
    with pytest.raises(LayoutError, match="not all in the root"):
        Layout.of_instance([0, 1, 2, 3], [0, 9])
