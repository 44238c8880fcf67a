"""The (pp, dp, tp) rank layout: pure arithmetic, no processes (simulated nodes)."""

import pytest

from mtnlg_lightning.errors import MTNLGError
from mtnlg_lightning.parallel.layout import ParallelLayout


def two_nodes_of_four(tp=2, pp=1, **kw):
    return ParallelLayout(world_size=8, tensor_parallel=tp, pipeline_parallel=pp, gpus_per_node=4, **kw)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (1, 2)])
def test_tensor_parallel_groups_never_cross_a_node(tp, pp):
    layout = two_nodes_of_four(tp, pp)
    for group in layout.tensor_parallel_groups():
        assert len({layout.node(r) for r in group}) == 1, group
        assert group == list(range(group[0], group[0] + tp)), "TP groups are consecutive ranks"


def test_coordinates_are_row_major_pp_dp_tp_with_tp_innermost():
    layout = two_nodes_of_four(tp=2, pp=2)  # dp = 2
    assert layout.data_parallel == 2
    coords = [(c.pp, c.dp, c.tp) for c in map(layout.coord, range(8))]
    assert coords == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert all(layout.rank(*coords[r]) == r for r in range(8))


def test_groups_of_the_mtnlg_composition_tp2_pp2_dp2():
    layout = two_nodes_of_four(tp=2, pp=2)
    assert layout.tensor_parallel_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.data_parallel_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]  # same (pp, tp)
    assert layout.pipeline_parallel_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]  # same (dp, tp)
    # DeepSpeed's model-parallel group: the pp x tp ranks of one replica, ordered by pp * TP + tp.
    assert layout.model_parallel_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_every_rank_is_in_exactly_one_group_of_each_kind():
    layout = two_nodes_of_four(tp=2, pp=2)
    for groups in (
        layout.tensor_parallel_groups(),
        layout.data_parallel_groups(),
        layout.pipeline_parallel_groups(),
        layout.model_parallel_groups(),
    ):
        assert sorted(r for g in groups for r in g) == list(range(8))


def test_mapping_table_names_node_local_rank_coordinates_and_groups():
    table = two_nodes_of_four(tp=2, pp=2).table().splitlines()
    assert table[0] == "layout: world 8 = pp 2 x dp 2 x tp 2 on 2 node(s) of 4 rank(s)"
    assert table[1].split() == ["rank", "node", "local", "pp", "dp", "tp", "tp", "group", "dp", "group", "pp", "group"]
    # rank 5: node 1, local rank 1, (pp 1, dp 0, tp 1); TP with 4, DP with 7, PP with 1.
    assert table[2 + 5].split() == ["5", "1", "1", "1", "0", "1", "4,5", "5,7", "1,5"]
    assert table[2 + 2].split() == ["2", "0", "2", "0", "1", "0", "2,3", "0,2", "2,6"]
    assert len(table) == 2 + 8


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(world_size=6, tensor_parallel=4),
            "world size 6 is not divisible by tensor_parallel 4 x pipeline_parallel 1 = 4",
        ),
        (
            dict(world_size=8, tensor_parallel=2, pipeline_parallel=3),
            "world size 8 is not divisible by tensor_parallel 2 x pipeline_parallel 3 = 6",
        ),
        (
            dict(world_size=8, tensor_parallel=8, gpus_per_node=4),
            "tensor_parallel 8 is larger than a node (4 ranks per node): TP groups would cross nodes; "
            "lower tensor_parallel or set allow_tp_across_nodes: true",
        ),
        (dict(world_size=12, tensor_parallel=4, gpus_per_node=6), "tensor_parallel 4 does not divide the node size 6"),
        (dict(world_size=6, gpus_per_node=4), "world size 6 is not a whole number of nodes of gpus_per_node 4"),
    ],
)
def test_invalid_layouts_fail_with_one_line_naming_the_numbers(kwargs, message):
    with pytest.raises(MTNLGError) as error:
        ParallelLayout(**kwargs)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_tp_across_nodes_only_with_explicit_opt_in():
    layout = ParallelLayout(world_size=8, tensor_parallel=8, gpus_per_node=4, allow_tp_across_nodes=True)
    assert {layout.node(r) for r in layout.tensor_parallel_groups()[0]} == {0, 1}


def test_a_single_node_smaller_than_gpus_per_node_is_fine():
    assert ParallelLayout(world_size=4, tensor_parallel=4, gpus_per_node=8).num_nodes == 1


@pytest.mark.parametrize(
    "heads,vocab,layers,tp,pp,message",
    [
        (4, 4096, 2, 8, 1, "num_heads 4 is not divisible by tensor_parallel 8"),
        (6, 4100, 2, 4, 1, "num_heads 6 is not divisible by tensor_parallel 4"),
        (8, 4098, 2, 4, 1, "padded vocabulary 4098 is not divisible by tensor_parallel 4"),
        (4, 4096, 2, 1, 4, "num_layers 2 is fewer than pipeline_parallel 4 stages"),
    ],
)
def test_model_that_does_not_split_evenly_fails_naming_the_numbers(heads, vocab, layers, tp, pp, message):
    layout = ParallelLayout(world_size=8, tensor_parallel=tp, pipeline_parallel=pp)
    with pytest.raises(MTNLGError, match=message):
        layout.validate_model(heads, vocab, layers)
