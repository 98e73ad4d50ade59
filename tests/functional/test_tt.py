"""TT-matrix math (szo.functional.tt) against tensorly and the parameter-count formula."""
import pytest
import torch
from tensorly.tt_matrix import tt_matrix_to_tensor

from szo.functional.tt import factorize, max_tt_ranks, tt_num_params, tt_ranks, tt_svd_matrix, tt_to_matrix


def _random_cores(m_shape, n_shape, ranks, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(ranks[k], m_shape[k], n_shape[k], ranks[k + 1], generator=g, dtype=torch.float64)
            for k in range(len(m_shape))]


@pytest.mark.parametrize("m_shape,n_shape,ranks", [((4, 3, 2), (2, 5, 3), (1, 3, 2, 1)),
                                                    ((5, 2), (16, 16), (1, 4, 1)),
                                                    ((4, 4), (12, 12), (1, 7, 1))])
def test_tt_svd_of_a_low_rank_tt_tensor_reconstructs_it(m_shape, n_shape, ranks):
    W = tt_to_matrix(_random_cores(m_shape, n_shape, ranks))
    cores = tt_svd_matrix(W, m_shape, n_shape, ranks)
    assert [tuple(c.shape) for c in cores] == [(ranks[k], m_shape[k], n_shape[k], ranks[k + 1])
                                               for k in range(len(m_shape))]
    assert (tt_to_matrix(cores) - W).abs().max() / W.abs().max() < 1e-6
    assert sum(c.numel() for c in cores) == tt_num_params(m_shape, n_shape, ranks)


def test_contraction_equals_tensorly():
    m_shape, n_shape, ranks = (3, 2, 2), (2, 3, 4), (1, 2, 3, 1)
    cores = _random_cores(m_shape, n_shape, ranks, seed=3)
    ref = tt_matrix_to_tensor([c.numpy() for c in cores]).reshape(12, 24)
    assert torch.allclose(tt_to_matrix(cores), torch.as_tensor(ref), atol=1e-12)


def test_param_count_formula_on_the_papers_mlp():
    # seed 000 Sec. 4: 784x1024 folded as 7x4x4x7 by 8x4x4x8 with ranks [1, r, r, r, 1]
    m, n, r = (7, 4, 4, 7), (8, 4, 4, 8), (1, 8, 8, 8, 1)
    assert tt_num_params(m, n, r) == 1 * 7 * 8 * 8 + 8 * 4 * 4 * 8 + 8 * 4 * 4 * 8 + 8 * 7 * 8 * 1


def test_factorize_and_max_ranks():
    assert factorize(256, 2) == (16, 16) and factorize(10, 2) == (5, 2) and factorize(144, 2) == (12, 12)
    assert factorize(7, 2) == (7, 1) and factorize(1, 3) == (1, 1, 1)
    assert max_tt_ranks((5, 2), (16, 16)) == (1, 32, 1)


def test_ranks_larger_than_the_layer_get_one_clear_error():
    with pytest.raises(ValueError, match=r"larger than layer 'fc'.*largest ranks are \[1, 32, 1\]"):
        tt_ranks(33, (5, 2), (16, 16), where="layer 'fc'")
    with pytest.raises(ValueError, match="must be an int or"):
        tt_ranks([1, 0, 1], (5, 2), (16, 16))
    with pytest.raises(ValueError, match="does not factor"):
        tt_svd_matrix(torch.zeros(10, 256), (5, 3), (16, 16), (1, 2, 1))
