# The losses the local rules add to cross-entropy: mutual learning (DMLU), relational distillation (CADIS), the
# proximal term (FedProx), balanced CE and compensation distillation (KAFAL), in torch.
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from edge_agent.data.image_arrays import model_input
from edge_agent.learning.acquisition_scores import class_prior_bias

MIN_KD_BATCH = 3


def prediction_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H(softmax(logits)) per sample, in nats."""
    log_p = nn.functional.log_softmax(logits, dim=1)
    return -(log_p.exp() * log_p).sum(dim=1)


def distillation_kl(target_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(target) || softmax(logits)) per sample; the target distribution is detached (no gradient)."""
    log_target = nn.functional.log_softmax(target_logits.detach(), dim=1)
    return (log_target.exp() * (log_target - nn.functional.log_softmax(logits, dim=1))).sum(dim=1)


def confidence_coefficients(logits: torch.Tensor) -> torch.Tensor:
    """DMLU's per-sample coefficient e^{-H(p)}, detached; it lies in [1/C, 1]."""
    return torch.exp(-prediction_entropy(logits.detach()))


def mutual_losses(
    local_logits: torch.Tensor,
    meme_logits: torch.Tensor,
    targets: torch.Tensor,
    local_coefficients: torch.Tensor,
    meme_coefficients: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_local, L_meme) of deep mutual learning: each model's CE plus its per-sample weighted, batch-mean KL
    towards the other model's detached prediction."""
    local_loss = (
        nn.functional.cross_entropy(local_logits, targets)
        + (local_coefficients * distillation_kl(meme_logits, local_logits)).mean()
    )
    meme_loss = (
        nn.functional.cross_entropy(meme_logits, targets)
        + (meme_coefficients * distillation_kl(local_logits, meme_logits)).mean()
    )
    return local_loss, meme_loss


def dmlu_losses(
    local_logits: torch.Tensor, meme_logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """FMLU's Eq. 3-4: L_local = CE + e^{-H(p_meme)} KL(p_meme||p_local), L_meme = CE + e^{-H(p_local)} KL(p_local||p_meme)."""
    return mutual_losses(
        local_logits, meme_logits, targets, confidence_coefficients(meme_logits), confidence_coefficients(local_logits)
    )


def mean_prediction_entropy(model: nn.Module, images: np.ndarray, batch_size: int = 256) -> float:
    """The model's mean H(p) over images with dropout off (FMLU's H_c); nan for no images."""
    if len(images) == 0:
        return float("nan")
    model.eval()
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            inputs = torch.from_numpy(model_input(images[start : start + batch_size]))
            total += float(prediction_entropy(model(inputs)).sum())
    return total / len(images)


def kernel_neighbour_distribution(features: torch.Tensor) -> torch.Tensor:
    """p_{j|i} over a batch's other samples (B x (B-1)), with the CADIS code's kernel on pairwise distances:
    K_ij = exp(-(d_ij - mean d)^2 / (2 (std(d)^2 + 1e-3))), d the off-diagonal Euclidean distances."""
    count = len(features)
    if count < MIN_KD_BATCH:
        raise ValueError(f"relational distillation needs at least {MIN_KD_BATCH} samples per batch, got {count}")
    distances = torch.cdist(features, features)
    off_diagonal = ~torch.eye(count, dtype=torch.bool)
    d = distances[off_diagonal].reshape(count, count - 1)
    kernel = torch.exp(-0.5 * (d - d.mean()) ** 2 / (d.std() ** 2 + 1e-3))
    return kernel / kernel.sum(dim=1, keepdim=True)


def relational_kd_loss(student_features: torch.Tensor, teacher_features: torch.Tensor) -> torch.Tensor:
    """CADIS's Eq. 18-19: sum_i sum_{j!=i} p_{j|i} ln(p_{j|i} / q_{j|i}), p from the teacher, q from the student."""
    teacher = kernel_neighbour_distribution(teacher_features.detach())
    student = kernel_neighbour_distribution(student_features)
    return (teacher * (teacher.log() - student.log())).sum()


def proximal_term(model: nn.Module, anchors: list[torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx's (mu/2) ||w - w^t||^2 over every parameter, w^t being the round's global model."""
    squares = (((parameter - anchor) ** 2).sum() for parameter, anchor in zip(model.parameters(), anchors))
    return 0.5 * mu * sum(squares, torch.zeros(()))


def balanced_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, class_counts: np.ndarray, tau: float = 1.0
) -> torch.Tensor:
    """KAFAL Eq. 4 (tau = 1): CE(g(x) + tau ln n, y), the logit-adjusted loss (a class without labels gets -inf;
    tau = 0 is plain CE)."""
    bias = torch.from_numpy(class_prior_bias(class_counts, tau)).to(logits.dtype)
    return nn.functional.cross_entropy(logits + bias, targets)


def compensation_weights(class_counts: np.ndarray) -> np.ndarray:
    """KAFAL's Gamma per pseudo-label class as the authors' code computes it: (1/n_c) / sum_{n_c' > 0} (1/n_c'),
    0 for a class without labels.

    On the labelled classes this is the paper's N_k / n_{k,c} divided by a per-device constant (the same relative
    weights); the paper's scale (up to N_k) and its undefined n = 0 case made the local model collapse on the bench.
    """
    counts = np.asarray(class_counts, dtype=np.float64)
    inverse = np.where(counts > 0, 1.0 / np.maximum(counts, 1.0), 0.0)
    total = inverse.sum()
    return inverse / total if total > 0 else inverse


def compensation_loss(
    student: nn.Module,
    teacher: nn.Module,
    unlabelled: torch.Tensor,
    class_counts: np.ndarray,
    generator: torch.Generator,
) -> torch.Tensor:
    """KAFAL Eq. 5 on one unlabelled batch: Gamma-weighted KL(teacher || student) on mixup of the batch.

    x~ = beta x'_1 + (1-beta) x'_2 with beta ~ Beta(2,2) per sample and the partner from a random permutation;
    Gamma(x~) mixes the Gammas of the teacher's pseudo-labels of x'_1 and x'_2 the same way.
    """
    partner = torch.randperm(len(unlabelled), generator=generator)
    beta = torch.distributions.Beta(2.0, 2.0).sample((len(unlabelled),))
    mixed = beta.view(-1, 1, 1, 1) * unlabelled + (1 - beta.view(-1, 1, 1, 1)) * unlabelled[partner]
    with torch.no_grad():
        gamma = torch.from_numpy(compensation_weights(class_counts)).float()[teacher(unlabelled).argmax(dim=1)]
        gamma = beta * gamma + (1 - beta) * gamma[partner]
        teacher_log = torch.log_softmax(teacher(mixed), dim=1)
    student_log = torch.log_softmax(student(mixed), dim=1)
    divergence = torch.sum(teacher_log.exp() * (teacher_log - student_log), dim=1)
    return torch.mean(gamma * divergence)
