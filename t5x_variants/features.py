"""Names and ids shared by the data pipeline, the models and the trainer, and the check of a
resumed run's batch shapes that both its data sources make (no dependencies)."""

ARCHITECTURES = ('encoder_decoder', 'decoder_only', 'encoder_only')
# The rows the data layer builds: one kind per architecture, and T5's prefix LM (a decoder-only
# model's row of inputs then targets, TransformerConfig.prefix_lm).
DATA_ARCHITECTURES = ARCHITECTURES + ('prefix_lm',)
# The layer stacks of each architecture, in the order the model's __call__ takes their tokens.
STACKS = {'encoder_decoder': ('encoder', 'decoder'), 'decoder_only': ('decoder',),
          'encoder_only': ('encoder',)}
# T5's special ids (every vocabulary here keeps them): padding, end of sequence, unknown.
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2


def check_batch_shapes(saved, now):
  """ValueError if a checkpoint's batches ({feature: [dtype, *shape]}, per host) differ from this
  run's: another batch size or feature lengths, which the data would show only at the first
  batch, if at all."""
  spec = lambda s: f'{s[0]}{s[1:]}' if s else 'none'  # 'int32[4, 64]'
  differ = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
  if differ:
    k = differ[0]
    raise ValueError(f'its batches had {k} {spec(saved.get(k))}, this run\'s {spec(now.get(k))} '
                     f'({len(differ)} feature(s) differ: another batch size or feature lengths)')
