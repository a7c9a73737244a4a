"""Names and ids shared by the data pipeline, the models and the trainer (no dependencies)."""

ARCHITECTURES = ('encoder_decoder', 'decoder_only', 'encoder_only')
# The rows the data layer builds: one kind per architecture, and T5's prefix LM (a decoder-only
# model's row of inputs then targets, TransformerConfig.prefix_lm).
DATA_ARCHITECTURES = ARCHITECTURES + ('prefix_lm',)
# The layer stacks of each architecture, in the order the model's __call__ takes their tokens.
STACKS = {'encoder_decoder': ('encoder', 'decoder'), 'decoder_only': ('decoder',),
          'encoder_only': ('encoder',)}
# T5's special ids (every vocabulary here keeps them): padding, end of sequence, unknown.
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
