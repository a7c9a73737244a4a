"""``python -m t5x_variants.train`` = t5xv-train (``t5x_variants.run_train``, outside this
TensorFlow-free package because it reads data)."""
import sys

from t5x_variants import run_train

sys.exit(run_train.main())
