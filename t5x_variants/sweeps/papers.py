"""Published numbers that ``t5xv-report`` prints beside a sweep's, keyed by variant name (the
stem of the variant's gin file). Only numbers read from the papers themselves are here."""
import dataclasses
from typing import Mapping, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class Table:
  title: str
  source: str
  columns: Tuple[str, ...]
  rows: Mapping[str, Tuple[Optional[float], ...]]  # variant -> one value per column
  rank_column: int = 0  # the column our final log-perplexity is ranked against
  lower_is_better: bool = True


GLU = Table(
    title='GLU Variants Improve Transformer, Table 1: held-out log-perplexity (C4 span corruption, '
          'T5-base size, parameter-matched FFNs)',
    source='Shazeer 2020, arXiv:2002.05202, Table 1',
    columns=('65,536 steps', '524,288 steps'),
    rows={'relu': (1.997, 1.677), 'gelu': (1.983, 1.679), 'swish': (1.994, 1.683),
          'glu': (1.982, 1.663), 'bilinear': (1.960, 1.648), 'geglu': (1.942, 1.633),
          'swiglu': (1.944, 1.636), 'reglu': (1.953, 1.645)})

TABLES = {'glu': GLU}
