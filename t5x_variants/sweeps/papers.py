"""Published results that ``t5xv-report`` prints beside a sweep's, keyed by variant name (the
stem of the variant's gin file). Only what was read in the papers' own text is here: numbers where
their tables could be read, otherwise the findings their text states (``findings``)."""
import dataclasses
from typing import Mapping, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Table:
  title: str
  source: str
  columns: Tuple[str, ...] = ()
  rows: Mapping[str, Tuple[Optional[float], ...]] = dataclasses.field(default_factory=dict)
  rank_column: int = 0  # the column our final log-perplexity is ranked against
  lower_is_better: bool = True
  findings: str = ''  # what the paper's text states, where its table's cells are not given here


GLU = Table(
    title='GLU Variants Improve Transformer, Table 1: held-out log-perplexity (C4 span corruption, '
          'T5-base size, parameter-matched FFNs)',
    source='Shazeer 2020, arXiv:2002.05202, Table 1; the std is over 4 runs of 65,536 steps',
    columns=('65,536 steps', 'std (4 runs)', '524,288 steps'),
    rows={'relu': (1.997, 0.005, 1.677), 'gelu': (1.983, 0.005, 1.679),
          'swish': (1.994, 0.003, 1.683), 'glu': (1.982, 0.006, 1.663),
          'bilinear': (1.960, 0.005, 1.648), 'geglu': (1.942, 0.004, 1.633),
          'swiglu': (1.944, 0.010, 1.636), 'reglu': (1.953, 0.003, 1.645)})

DEEPNET = Table(
    title='DeepNet: Scaling Transformers to 1,000 Layers, Table 1 (WMT-17 En-De BLEU by depth)',
    source='Wang et al. 2022, arXiv:2203.00555, Section 5',
    findings='Post-LN baselines become unstable (diverge) at 50L-50L and deeper; DeepNet (DeepNorm) '
             'trains at every depth up to 100L-100L (28.9 BLEU); Pre-LN trains at every depth but '
             'is 0.5-1.0 BLEU below the converged Post-LN models. The model update ||F(x;θt) - '
             'F(x;θ0)|| of Post-LN explodes at the very start of training and then nearly stops.')

MAGNETO = Table(
    title='Foundation Transformers (Magneto): Sub-LN against Pre-LN',
    source='Wang et al. 2022, arXiv:2210.06423',
    findings='Sub-LN (Magneto) is better than Pre-LN on every modality: e.g. +0.6 average GLUE for '
             'BERT, +0.5 BLEU on OPUS-100 translation (where Post-LN does not converge at '
             '18L-18L). The paper reports downstream scores (GPT in-context accuracy, GLUE, BLEU), '
             'not the pretraining perplexities measured here.')

SYNTHESIZER = Table(
    title='Synthesizer: Rethinking Self-Attention for Transformer Models',
    source='Tay et al. 2021, arXiv:2005.00743',
    findings='Random and dense synthesizers are competitive with dot-product attention, and the '
             'mixtures with it (R+V, D+V) match or beat it; the per-variant C4 log-perplexities '
             'of the paper\'s tables were not available to us, so none are printed.')

TABLES = {'glu': GLU, 'deepnet': DEEPNET, 'magneto': MAGNETO, 'synthesizer': SYNTHESIZER}
