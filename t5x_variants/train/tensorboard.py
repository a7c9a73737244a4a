"""Scalar TensorBoard event files written without TensorFlow.

An event file is a TFRecord stream (length, masked CRC-32C of the length, payload, masked CRC-32C
of the payload) of ``Event`` protocol buffers; the few fields a scalar needs are encoded here by
hand (Event: wall_time=1, step=2, file_version=3, summary=5; Summary.value=1; Value: tag=1,
simple_value=2), so the train layer stays free of TensorFlow and of the tensorboard package.
"""
import os
import socket
import struct
import time
from typing import Mapping

_CRC32C_TABLE = []
for _i in range(256):
  _c = _i
  for _ in range(8):
    _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
  _CRC32C_TABLE.append(_c)


def crc32c(data: bytes) -> int:
  crc = 0xFFFFFFFF
  for b in data:
    crc = _CRC32C_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
  out = bytearray()
  while True:
    byte, n = n & 0x7F, n >> 7
    out.append(byte | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
  """A length-delimited protobuf field."""
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(step: int, wall_time: float, file_version: str = None, scalars=None) -> bytes:
  msg = b'\x09' + struct.pack('<d', wall_time) + b'\x10' + _varint(step)
  if file_version:
    msg += _field(3, file_version.encode())
  if scalars:
    values = b''.join(_field(1, _field(1, tag.encode()) + b'\x15' + struct.pack('<f', value))
                      for tag, value in scalars.items())
    msg += _field(5, values)
  return msg


class EventWriter:
  """Appends scalar summaries to one event file in ``logdir``."""

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    name = f'events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}'
    self._file = open(os.path.join(logdir, name), 'ab')
    self._write(_event(0, time.time(), file_version='brain.Event:2'))

  def _write(self, record: bytes):
    length = struct.pack('<Q', len(record))
    self._file.write(length + struct.pack('<I', _masked_crc(length)) + record +
                     struct.pack('<I', _masked_crc(record)))

  def scalars(self, step: int, values: Mapping[str, float]):
    self._write(_event(step, time.time(), scalars={k: float(v) for k, v in values.items()}))
    self._file.flush()

  def close(self):
    self._file.close()
