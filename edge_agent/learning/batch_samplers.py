# The samplers that read more than probabilities or choose a batch as a whole: KSAS and FAST (logits, a frozen
# encoder), power draws, BADGE, core-set, class-balanced top-k, TypiClust, and phases that hand one over to another.
from __future__ import annotations

from typing import ClassVar

import numpy as np

from edge_agent.learning.acquisition_scores import (
    entropy_scores,
    knn_labels,
    ksas_scores,
    margin_scores,
    prototype_entropy,
    prototype_similarities,
    top_k,
)
from edge_agent.learning.batch_selection import (
    badge_parts,
    class_balanced_top_k,
    k_center_greedy,
    kmeans,
    kmeans_pp_outer,
    level_quotas,
    nearest_squared_distances,
    power_sample,
    principal_rows,
    quota_picks,
    typical_picks,
    typicality,
)
from edge_agent.learning.heuristics import (
    COLD_START,
    AcquisitionContext,
    BaldHeuristic,
    EntropyHeuristic,
    MarginHeuristic,
    Sampler,
)
from protocol.options import Option


class KsasSampler(Sampler):
    """KAFAL's knowledge-specialised sampler: largest discrepancy between the device's own and the global model."""

    name = "ksas"
    summary = "KAFAL: discrepancy between the device's own and the global model, class-count weighted"
    needs_model_logits = True
    options = (
        COLD_START,
        Option("lambda", float, 1.0, "KSAS knowledge weight lambda", low=0.0, flag="--ksas-lambda"),
    )

    def score_pool(self, context: AcquisitionContext) -> np.ndarray:
        """ksas_scores of the own model and the downloaded global model, lambda from the recipe (default 1)."""
        return ksas_scores(
            context.own_logits(),
            context.global_logits(),
            context.class_counts,
            self.option_value(context.options, "lambda"),
        )


class FastSampler(Sampler):
    """FAST: frozen-encoder prototype entropy decides what a person labels; kNN votes label the rest weakly."""

    name = "fast"
    summary = "FAST: frozen-encoder prototype entropy asks people; kNN votes label the rest weakly"
    needs_encoder = True
    options = (
        COLD_START,
        Option("knn_k", int, 10, "FAST: neighbours voting for a weak label", low=1.0, flag="--knn-k"),
    )

    def score_pool(self, context: AcquisitionContext) -> np.ndarray:
        """Prototype-cosine entropy of each pool embedding against the device's human-labelled seeds."""
        pool, reference, labels = context.embeddings()
        return prototype_entropy(*prototype_similarities(pool, reference, labels, len(context.class_counts)))

    def weak_labels(self, context: AcquisitionContext) -> np.ndarray:
        """kNN majority labels of every pool sample (k from the recipe, default 10)."""
        pool, reference, labels = context.embeddings()
        return knn_labels(
            pool, reference, labels, int(self.option_value(context.options, "knn_k")), len(context.class_counts)
        )


class PowerSampler(Sampler):
    """Stochastic batch acquisition (Kirsch et al., TMLR 2023) composed over any score sampler (`base`): the batch
    is a draw in proportion to (base score + offset)^beta, for diverse batches without a pairwise term and a cold
    start that is not all one kind of sample. A subclass names the base and the offset that makes its score
    non-negative; it asks the device for what the base asks."""

    base: ClassVar[type[Sampler]]
    offset: ClassVar[float] = 0.0
    options = (
        COLD_START,
        Option("power_beta", float, 1.0, "power of the score the draw follows", low=0.0, flag="--power-beta"),
    )

    def __init_subclass__(cls, **kwargs: object) -> None:
        """A power sampler needs what its base needs (the encoder, the whole-model logits)."""
        super().__init_subclass__(**kwargs)
        cls.needs_encoder, cls.needs_model_logits = cls.base.needs_encoder, cls.base.needs_model_logits

    def score_pool(self, context: AcquisitionContext) -> np.ndarray:
        """The base sampler's score of every pool sample plus the offset (rounding noise below 0 clipped to 0)."""
        return np.maximum(self.base().score_pool(context) + self.offset, 0.0)

    def select(self, context: AcquisitionContext, budget: int) -> np.ndarray:
        """A draw of `budget` samples with probability in proportion to score^beta."""
        beta = self.option_value(context.options, "power_beta")
        return power_sample(self.score_pool(context), budget, beta, context.rng)


class PowerEntropy(PowerSampler):
    """Power sampling over the predictive entropy."""

    name = "power-entropy"
    summary = "draw in proportion to entropy^beta (stochastic batch acquisition)"
    base = EntropyHeuristic


class PowerBald(PowerSampler):
    """Power sampling over BALD."""

    name = "power-bald"
    summary = "draw in proportion to BALD^beta (stochastic batch acquisition, Kirsch et al. 2023)"
    base = BaldHeuristic


class PowerMargin(PowerSampler):
    """Power sampling over one minus the top-two margin (the margin score, minus the gap, shifted into [0, 1])."""

    name = "power-margin"
    summary = "draw in proportion to (1 - top-two margin)^beta (stochastic batch acquisition)"
    base = MarginHeuristic
    offset = 1.0


class BadgeSampler(Sampler):
    """BADGE (Ash et al., ICLR 2020): k-means++ over last-layer gradient embeddings from the MC-dropout mean, so a
    batch is uncertain (long embeddings) and diverse (far apart)."""

    name = "badge"
    summary = "k-means++ over last-layer gradient embeddings: uncertain and diverse batches"

    def score_pool(self, context: AcquisitionContext) -> np.ndarray:
        """Each sample's gradient-embedding length, |p - onehot| |features|."""
        residual, features = badge_parts(context.probabilities().mean(axis=0), context.features())
        return np.linalg.norm(residual, axis=1) * np.linalg.norm(features, axis=1)

    def select(self, context: AcquisitionContext, budget: int) -> np.ndarray:
        """The k-means++ seeds of the gradient embeddings."""
        residual, features = badge_parts(context.probabilities().mean(axis=0), context.features())
        return kmeans_pp_outer(residual, features, budget, context.rng)


class CoresetSampler(Sampler):
    """Core-set (Sener and Savarese, ICLR 2018): greedy k-center over the penultimate features, the device's
    human-labelled samples the first centres, so a batch covers what the labels do not (no model uncertainty)."""

    name = "coreset"
    summary = "greedy k-center over penultimate features from the labelled samples: batches that cover the pool"
    options = (COLD_START,)

    def score_pool(self, context: AcquisitionContext) -> np.ndarray:
        """Each sample's Euclidean distance to its nearest human-labelled sample in feature space (inf without one)."""
        return np.sqrt(nearest_squared_distances(context.features(), context.labelled_features()))

    def select(self, context: AcquisitionContext, budget: int) -> np.ndarray:
        """The greedy k-center picks, farthest first."""
        return k_center_greedy(context.features(), context.labelled_features(), budget, context.rng)


class BalancedEntropy(Sampler):
    """Top entropy per predicted class: at most an equal share of the batch from every class the model sees."""

    name = "balanced-entropy"
    summary = "highest entropy per predicted class, an equal share each (class-balanced batches)"

    def score_pool(self, context: AcquisitionContext) -> np.ndarray:
        """entropy_scores of the pool's MC-dropout probabilities."""
        return entropy_scores(context.probabilities())

    def select(self, context: AcquisitionContext, budget: int) -> np.ndarray:
        """class_balanced_top_k over the predicted (MC-dropout mean) classes."""
        probs = context.probabilities()
        predicted = np.argmax(probs.mean(axis=0), axis=1)
        return class_balanced_top_k(entropy_scores(probs), predicted, budget, probs.shape[2])


class MarginQuotas(Sampler):
    """A sampler whose per-sample score is the top-two margin of the MC-dropout probabilities (the smallest first)
    and whose batch is split into per-class quotas by a subclass's `select`: balanced and level margin."""

    def score_pool(self, context: AcquisitionContext) -> np.ndarray:
        """margin_scores of the pool's MC-dropout probabilities."""
        return margin_scores(context.probabilities())


class BalancedMargin(MarginQuotas):
    """Smallest margin first; where the pool's predicted class mix is skewed (its commonest predicted class at least
    `balance_skew` times its rarest), the top margins per predicted class, an equal share each, so a batch reaches
    the classes the pool holds few of (rare-class-seeking, after SIMILAR and DIRECT)."""

    name = "balanced-margin"
    summary = "smallest top-two margin; per predicted class, an equal share each, where the pool's mix is skewed"
    options = (
        COLD_START,
        Option(
            "balance_skew",
            float,
            3.0,
            "balanced-margin: the commonest : rarest predicted class ratio from which batches are class-balanced",
            low=1.0,
            flag="--balance-skew",
        ),
    )

    def select(self, context: AcquisitionContext, budget: int) -> np.ndarray:
        """class_balanced_top_k of the margins over the predicted (MC-dropout mean) classes when the predicted mix
        is skewed (a class predicted for no sample counts as rarest), else their top-k."""
        probs = context.probabilities()
        scores, classes = margin_scores(probs), probs.shape[2]
        predicted = np.argmax(probs.mean(axis=0), axis=1)
        counts = np.bincount(predicted, minlength=classes)
        if counts.max() < self.option_value(context.options, "balance_skew") * max(counts.min(), 1):
            return top_k(scores, budget)
        return class_balanced_top_k(scores, predicted, budget, classes)


class LevelMargin(MarginQuotas):
    """Quotas that level the device's label counts: each label of the batch in turn goes to the class with the
    fewest (labels held plus quota so far) among the classes the pool is predicted to hold, and each class's quota is
    filled by the samples predicted as it with the smallest margins, then, where too few are, by those most probably
    of it. Where balanced-margin gives every predicted class an equal share, this one aims at the counts after the
    batch, so a class the device holds few labels of gets more than one share."""

    name = "level-margin"
    summary = "per predicted class, quotas that level the device's label counts; in each, the smallest margins"

    def select(self, context: AcquisitionContext, budget: int) -> np.ndarray:
        """level_quotas of the class counts over the predicted classes, then quota_picks by margin."""
        probs = context.probabilities()
        mean = probs.mean(axis=0)
        predicted = np.bincount(np.argmax(mean, axis=1), minlength=probs.shape[2])
        quotas = level_quotas(np.where(predicted > 0, context.class_counts, np.inf), budget)
        return quota_picks(margin_scores(probs), mean, quotas)


class TypicalitySampler(Sampler):
    """TypiClust (Hacohen et al., ICML 2022): k-means of the pool and the human-labelled samples in the penultimate
    features (a head-only device's cached backbone rows), into as many clusters as labels after this batch (capped);
    the batch is the most typical sample of each of the largest clusters no label covers. No model output is used,
    so it chooses well before the head knows anything: a device's first acquisitions."""

    name = "typiclust"
    summary = "TypiClust: the most typical sample of each of the largest clusters no label covers (no model needed)"
    options = (
        COLD_START,
        Option("typical_dims", int, 32, "TypiClust: principal directions k-means runs in", low=1.0),
        Option("typical_neighbours", int, 20, "TypiClust: neighbours a sample's typicality averages", low=1.0),
        Option("typical_clusters", int, 100, "TypiClust: most clusters (labels + batch, capped here)", low=1.0),
    )

    def clustered(self, context: AcquisitionContext, budget: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(the pool's projected features, each pool sample's cluster, labels per cluster) for a batch of `budget`."""
        dims, most = (int(self.option_value(context.options, key)) for key in ("typical_dims", "typical_clusters"))
        pool, labelled = principal_rows(context.features(), context.labelled_features(), dims, context.rng)
        clusters = kmeans(np.vstack([pool, labelled]), min(len(labelled) + budget, most), context.rng)
        return pool, clusters[: len(pool)], np.bincount(clusters[len(pool) :], minlength=clusters.max() + 1)

    def score_pool(self, context: AcquisitionContext) -> np.ndarray:
        """Each sample's typicality within its cluster."""
        pool, clusters, _ = self.clustered(context, 0)
        neighbours = int(self.option_value(context.options, "typical_neighbours"))
        scores = np.zeros(len(pool))
        for cluster in np.unique(clusters):
            members = np.flatnonzero(clusters == cluster)
            scores[members] = typicality(pool[members], neighbours)
        return scores

    def select(self, context: AcquisitionContext, budget: int) -> np.ndarray:
        """typical_picks over the clusters, typicality computed for the clusters it picks from only."""
        pool, clusters, covered = self.clustered(context, budget)
        neighbours = int(self.option_value(context.options, "typical_neighbours"))
        return typical_picks(clusters, covered, lambda members: typicality(pool[members], neighbours), budget)


FIRST_LABELS = Option(
    "first_labels",
    int,
    10,
    "phased samplers: below this many human labels on a device the first sampler chooses, the second after",
    low=0.0,
)


class PhasedSampler(Sampler):
    """Two samplers by the device's human labels: `first` while it holds fewer than `first_labels`, `then` after
    (a subclass names both); it asks the device for what either asks and takes both samplers' options."""

    first: ClassVar[type[Sampler]]
    then: ClassVar[type[Sampler]]

    def __init_subclass__(cls, **kwargs: object) -> None:
        """Needs and options are the union of the two samplers' (first_labels added)."""
        super().__init_subclass__(**kwargs)
        cls.needs_encoder = cls.first.needs_encoder or cls.then.needs_encoder
        cls.needs_model_logits = cls.first.needs_model_logits or cls.then.needs_model_logits
        declared = (*cls.first.options, *cls.then.options, FIRST_LABELS)
        cls.options = tuple({option.key: option for option in declared}.values())

    def phase(self, context: AcquisitionContext) -> Sampler:
        """The sampler that chooses now."""
        first = context.class_counts.sum() < FIRST_LABELS.read(context.options)
        return (self.first if first else self.then)()

    def score_pool(self, context: AcquisitionContext) -> np.ndarray:
        """The scores of the sampler that chooses now."""
        return self.phase(context).score_pool(context)

    def select(self, context: AcquisitionContext, budget: int) -> np.ndarray:
        """The batch of the sampler that chooses now."""
        return self.phase(context).select(context, budget)


class TypicalThenMargin(PhasedSampler):
    """TypiClust for a device's first labels, then the smallest margin."""

    name = "typical-then-margin"
    summary = "TypiClust for a device's first labels, then the smallest top-two margin"
    first, then = TypicalitySampler, MarginHeuristic


class TypicalThenBalancedMargin(PhasedSampler):
    """TypiClust for a device's first labels, then balanced-margin (class-balanced where the pool's mix is skewed):
    the camera path's default sampler."""

    name = "typical-then-balanced-margin"
    summary = "TypiClust for a device's first labels, then margin, class-balanced where the predicted mix is skewed"
    first, then = TypicalitySampler, BalancedMargin


class TypicalThenLevelMargin(PhasedSampler):
    """TypiClust for a device's first labels, then level-margin (quotas that level the label counts per class)."""

    name = "typical-then-level-margin"
    summary = "TypiClust for a device's first labels, then margin in quotas that level the label counts per class"
    first, then = TypicalitySampler, LevelMargin
