// What the tokenizer fixture generators share: GPT-2's byte-level alphabet and the layout of a
// Tekken tokenizer.json (Split by the Tekken regex + ByteLevel, ignore_merges, a <s> template), as
// transformers' TikTokenConverter writes it for Nemotron-H.
'use strict';

const TEKKEN_SPLIT = String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+`;

// GPT-2's bytes_to_unicode(): printable bytes stand for themselves, the other 68 for U+0100 + n.
const B2C = (() => {
  const map = [];
  let n = 0;
  for (let b = 0; b < 256; b++) {
    const printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    map[b] = String.fromCodePoint(printable ? b : 0x100 + n++);
  }
  return map;
})();
const byteLevel = (bytes) => Array.from(bytes, (b) => B2C[b]).join('');

// The tokenizer.json object: specials[i] is added token i, vocab maps token -> id, merges are [a, b].
function tekkenJson(specials, vocab, merges) {
  return {
    version: '1.0', truncation: null, padding: null,
    added_tokens: specials.map((s, i) => ({ id: i, content: s, single_word: false, lstrip: false,
      rstrip: false, normalized: false, special: true })),
    normalizer: null,
    pre_tokenizer: { type: 'Sequence', pretokenizers: [
      { type: 'Split', pattern: { Regex: TEKKEN_SPLIT }, behavior: 'Isolated', invert: false },
      { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false }] },
    post_processor: { type: 'TemplateProcessing',
      single: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
      pair: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
        { SpecialToken: { id: '<s>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
      special_tokens: { '<s>': { id: '<s>', ids: [1], tokens: ['<s>'] } } },
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: { type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null,
      end_of_word_suffix: null, fuse_unk: false, byte_fallback: false, ignore_merges: true, vocab, merges },
  };
}

module.exports = { TEKKEN_SPLIT, B2C, byteLevel, tekkenJson };
