"""GPT-3's quality classifier: logistic regression on hashed word n-gram features (scikit-learn), curated text as
positives and raw crawl as negatives; kept by a threshold or by GPT-3's Pareto rule ``np.random.pareto(alpha) >
1 - score``.

The model is saved as an ``.npz`` of plain arrays (weights, bias, settings as a JSON string) and loaded with
``allow_pickle=False``: loading a model file never runs code. The hashing vectoriser has no state, so the
weights and its settings are the whole model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import xxhash

import mtnlg_lightning.corpora.storage as storage
from mtnlg_lightning.corpora.jsonl import atomic_write

FORMAT = "mtnlg-quality-classifier/1"


@dataclass
class QualityModel:
    coef: np.ndarray  # (n_features,) float32
    intercept: float
    n_features: int
    max_ngram: int

    def vectorizer(self):
        from sklearn.feature_extraction.text import HashingVectorizer  # optional extra [crawl]: imported on use

        return HashingVectorizer(
            n_features=self.n_features,
            ngram_range=(1, self.max_ngram),
            alternate_sign=False,
            norm="l2",
            lowercase=True,
            token_pattern=r"(?u)\b\w+\b",
            dtype=np.float32,
        )

    def scores(self, texts: list[str]) -> np.ndarray:
        """P(curated | text) for each text."""
        if not texts:
            return np.zeros(0)
        logits = self.vectorizer().transform(texts) @ self.coef.astype(np.float64) + self.intercept
        return 1.0 / (1.0 + np.exp(-logits))

    def save(self, path: str) -> None:
        config = {"format": FORMAT, "n_features": self.n_features, "max_ngram": self.max_ngram}
        with atomic_write(path, "wb", fsync=True) as f:
            np.savez(f, coef=self.coef, intercept=np.array([self.intercept]), config=np.array(json.dumps(config)))

    @classmethod
    def load(cls, path: str) -> QualityModel:
        with storage.open_random_access(path) as f, np.load(f, allow_pickle=False) as z:
            config = json.loads(str(z["config"]))
            if config.get("format") != FORMAT:
                raise ValueError(f"{path}: not a {FORMAT} model")
            return cls(z["coef"], float(z["intercept"][0]), int(config["n_features"]), int(config["max_ngram"]))


def train(
    positives: list[str],
    negatives: list[str],
    n_features: int = 1 << 18,
    max_ngram: int = 2,
    c: float = 1.0,
    seed: int = 0,
) -> QualityModel:
    """Fit the logistic regression (classes balanced, as the two sides of a crawl rarely are)."""
    from sklearn.linear_model import LogisticRegression  # optional extra [crawl]: imported on use

    model = QualityModel(np.zeros(n_features, np.float32), 0.0, n_features, max_ngram)
    features = model.vectorizer().transform(positives + negatives)
    labels = np.r_[np.ones(len(positives)), np.zeros(len(negatives))]
    fit = LogisticRegression(C=c, class_weight="balanced", max_iter=1000, random_state=seed).fit(features, labels)
    model.coef = fit.coef_[0].astype(np.float32)
    model.intercept = float(fit.intercept_[0])
    return model


def pareto_draw(text: str, alpha: float, seed: int) -> float:
    """The document's own draw of ``np.random.pareto(alpha)``: seeded by (seed, hash of the text), so a document
    gets the same draw in any file, order or run, and a new threshold needs no new scores."""
    rng = np.random.default_rng([seed, xxhash.xxh64_intdigest(text.encode("utf-8"))])
    return float(rng.pareto(alpha))


def keep_pareto(score: float, text: str, alpha: float = 9.0, seed: int = 0) -> bool:
    """GPT-3's rule: keep when ``np.random.pareto(alpha) > 1 - score``."""
    return pareto_draw(text, alpha, seed) > 1.0 - score
