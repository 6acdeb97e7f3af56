#!/usr/bin/env node
// Builds nemoh's chat fixtures, with no hub access:
//
//   tests/fixtures/chat/tokenizer.json  a small byte-level BPE (Tekken split, ignore_merges, <s>
//       template, 1200 ids: 10 special tokens, the 256 bytes, 934 merges learned here from
//       tests/fixtures/tokenizer/corpus.txt and the conversations below) whose special tokens are
//       those of both chat formats, so that it fits the tiny-bf16 model (vocab_size 1200).
//   tests/fixtures/chat/{nano-v2,nemotron-3,chatml}/  the tiny-bf16 model (links) with that
//       tokenizer and one chat template each: tools/chat/*.jinja, in tokenizer_config.json's
//       chat_template (nano-v2, chatml) or in chat_template.jinja (nemotron-3), as the
//       checkpoints ship them.
//   tests/fixtures/chat/cases/*.json and expected.tsv  a matrix of conversations, and for each
//       format, reasoning switch and tokenizer the ids Hugging Face gives: the template rendered
//       by @huggingface/jinja (apply_chat_template's add_generation_prompt=True; nemoh's --think /
//       --no-think are enable_thinking for Nemotron 3, a /think or /no_think line at the end of
//       the system message for Nano v2), then encoded by HF tokenizers without the
//       post-processor's tokens (apply_chat_template's add_special_tokens=False). Nano v2 cases
//       are also encoded with the real Nemotron-H vocabulary (tests/fixtures/tokenizer/tekken).
//       Each rendering is also made by Python's jinja2 (render_chat.py, as transformers renders);
//       where the two differ, jinja2's is kept and the case named on stderr.
//
//   cd tools && npm ci && node make_tokenizers.js && node make_chat_fixtures.js
'use strict';
const fs = require('fs');
const path = require('path');
const { Tokenizer } = require('tokenizers');
const { execFileSync } = require('child_process');
const { Template } = require('@huggingface/jinja');
const { TEKKEN_SPLIT, B2C, byteLevel, tekkenJson } = require('./tekken');

const ROOT = path.join(__dirname, '..');
const FIX = path.join(ROOT, 'tests', 'fixtures', 'chat');
const SPECIALS = ['<unk>', '<s>', '</s>', '<SPECIAL_10>', '<SPECIAL_11>', '<SPECIAL_12>', '<|im_start|>',
  '<|im_end|>', '<think>', '</think>'];
const VOCAB = 1200;

// The conversations: no system / system, the reasoning switches, keywords in system vs user (the
// last wins), multi-turn with reasoning in earlier replies (dropped from history), non-ASCII text,
// whitespace at the ends of messages (stripped by one template, kept by the other).
const S = (content) => ({ role: 'system', content });
const U = (content) => ({ role: 'user', content });
const A = (content) => ({ role: 'assistant', content });
const CASES = {
  'user': [U('What is 17 * 23?')],
  'system': [S('You are a terse assistant.'), U('Name a prime.')],
  'system-no-think': [S('You are a terse assistant. /no_think'), U('Name a prime.')],
  'user-no-think': [U('/no_think Hello there')],
  'system-no-think-user-think': [S('/no_think'), U('Explain tides. /think')],
  'system-think-user-no-think': [S('Be brief. /think'), U('Explain tides /no_think')],
  'multi-turn-reasoning': [S('You are helpful.'), U('What is 17 * 23?'),
    A('<think>\n17 * 23 = 17 * 20 + 17 * 3 = 340 + 51.\n</think>\nIt is 391.'), U('And 18 * 23?')],
  'multi-turn-three': [U('Hi!'), A('<think>\nA greeting.\n</think>\nHello! How can I help?'),
    U('Tell me a joke.'), A('<think></think>Why did the chicken cross the road?'), U('Why?')],
  'multi-turn-no-reasoning': [U('Say yes.'), A('yes'), U('Say no.')],
  'non-ascii': [S('Réponds en français — s\'il te plaît.'), U('Grüße aus Köln! ¿Qué tal? 日本語で 😀 ok')],
  'whitespace': [S('  padded system  \n'), U('\n  spaced out \n\n'), A('  <think>\nhm\n</think>\n\n  ok  '),
    U(' again\t')],
};
// Python's str.strip (jinja2's trim and strip) against every whitespace class: earlier replies that
// are only whitespace once their reasoning is dropped, and each character str.isspace() knows
// around stripped text, beside U+FEFF, which JavaScript's trim strips and Python's does not. Kept
// out of the tokenizer's training text.
const STRIP_CASES = {
  'reply-only-reasoning': [U('q1'), A('<think>x</think>\n'), U('q2')],
  'reply-whitespace': [U('q1'), A(' \n\t \n'), U('q2')],
  'reply-python-whitespace': [U('q1'), A('\x85\u3000\x1c'), U('q2')],
  'strip-classes': [S('\x1c\x1d\x85 sys \xa0\u1680'), U('\x1e\u2000\u200a hi \u2028\u2029\x0b\x0c'),
    A('\x1f\u202f<think>r</think>\u205f ok \u3000\r\x85'), U('\ufeff q2 \ufeff')],
};
const TEMPLATES = {
  'nano-v2': 'nvidia-nemotron-nano-v2.jinja',
  'nemotron-3': 'nvidia-nemotron-3-nano.jinja',
  'chatml': 'chatml.jinja',
};

// Plain BPE training: the most frequent adjacent pair (ties by the pair's text), merged everywhere,
// until the vocabulary is full. Words are the Tekken split's pieces of the text between specials.
function train(text) {
  const split = new RegExp(TEKKEN_SPLIT, 'gu');
  const counts = new Map();
  for (const part of text.split(new RegExp(SPECIALS.map((s) => s.replace(/[|]/g, '\\|')).join('|'))))
    for (const m of part.matchAll(split)) {
      const w = byteLevel(Buffer.from(m[0], 'utf8'));
      counts.set(w, (counts.get(w) || 0) + 1);
    }
  const words = [...counts].map(([w, c]) => ({ syms: Array.from(w), c }));
  const vocab = {};
  SPECIALS.forEach((s, i) => { vocab[s] = i; });
  B2C.forEach((ch) => { vocab[ch] = Object.keys(vocab).length; });
  const merges = [];
  while (Object.keys(vocab).length < VOCAB) {
    const pairs = new Map();
    for (const { syms, c } of words)
      for (let i = 0; i + 1 < syms.length; i++) {
        const k = syms[i] + '\u0000' + syms[i + 1];
        pairs.set(k, (pairs.get(k) || 0) + c);
      }
    let best = null, bestN = 0;
    for (const [k, n] of pairs) if (n > bestN || (n === bestN && k < best)) { best = k; bestN = n; }
    if (!best) throw new Error('the training text is too small for the vocabulary');
    const [a, b] = best.split('\u0000');
    merges.push([a, b]);
    if (!(a + b in vocab)) vocab[a + b] = Object.keys(vocab).length;
    for (const w of words)
      for (let i = 0; i + 1 < w.syms.length; i++)
        if (w.syms[i] === a && w.syms[i + 1] === b) w.syms.splice(i, 2, a + b);
  }
  return { vocab, merges };
}

function buildTokenizer(text) {
  const { vocab, merges } = train(text);
  const out = path.join(FIX, 'tokenizer.json');
  Tokenizer.fromString(JSON.stringify(tekkenJson(SPECIALS, vocab, merges))).save(out, false);
  console.error(`${out}: ${Object.keys(vocab).length} tokens, ${merges.length} merges`);
  return Tokenizer.fromFile(out);
}

// The messages HF sees for nemoh's --think / --no-think (null: neither given).
function withSwitch(format, messages, think) {
  if (think === null || format !== 'nano-v2') return messages;
  const word = think ? '/think' : '/no_think';
  if (messages[0].role === 'system') return [S(messages[0].content + '\n' + word), ...messages.slice(1)];
  return [S(word), ...messages];
}

async function main() {
  const templates = {};
  for (const [f, file] of Object.entries(TEMPLATES))
    templates[f] = fs.readFileSync(path.join(__dirname, 'chat', file), 'utf8');
  const convText = Object.values(CASES).flat().map((m) => m.content).join('\n');
  const corpus = fs.readFileSync(path.join(ROOT, 'tests', 'fixtures', 'tokenizer', 'corpus.txt'), 'utf8');
  fs.mkdirSync(path.join(FIX, 'cases'), { recursive: true });
  const tok = await buildTokenizer(corpus + '\n' + convText);
  const tekken = Tokenizer.fromFile(path.join(ROOT, 'tests', 'fixtures', 'tokenizer', 'tekken', 'tokenizer.json'));

  // the model directories: tiny-bf16's weights, the chat tokenizer, each format's template
  for (const f of Object.keys(TEMPLATES)) {
    const dir = path.join(FIX, f);
    fs.mkdirSync(dir, { recursive: true });
    for (const [name, target] of [['config.json', '../../tiny-bf16/config.json'],
      ['model.safetensors', '../../tiny-bf16/model.safetensors'], ['tokenizer.json', '../tokenizer.json']]) {
      const p = path.join(dir, name);
      if (fs.existsSync(p)) fs.unlinkSync(p);
      fs.symlinkSync(target, p);
    }
    const cfg = { bos_token: '<s>', eos_token: f === 'nano-v2' ? '<SPECIAL_12>' : '<|im_end|>',
      model_max_length: 256, tokenizer_class: 'PreTrainedTokenizerFast' };
    if (f === 'nemotron-3') fs.writeFileSync(path.join(dir, 'chat_template.jinja'), templates[f]);
    else cfg.chat_template = templates[f];
    fs.writeFileSync(path.join(dir, 'tokenizer_config.json'), JSON.stringify(cfg, null, 2) + '\n');
  }

  const encode = async (t, text) => (await t.encode(text, null, { addSpecialTokens: false })).getIds();
  const jobs = [];
  for (const [name, messages] of Object.entries({ ...CASES, ...STRIP_CASES })) {
    fs.writeFileSync(path.join(FIX, 'cases', `${name}.json`), JSON.stringify(messages, null, 1) + '\n');
    for (const f of Object.keys(TEMPLATES))
      for (const think of f === 'chatml' ? [null] : [null, true, false]) {
        const kwargs = f === 'nemotron-3' && think !== null ? { enable_thinking: think } : {};
        const vars = { messages: withSwitch(f, messages, think), add_generation_prompt: true, bos_token: '<s>',
          eos_token: '</s>', ...kwargs };
        jobs.push({ f, name, sw: think === null ? '-' : think ? '--think' : '--no-think', template: templates[f], vars });
      }
  }
  const py = JSON.parse(execFileSync('python3', [path.join(__dirname, 'render_chat.py')],
    { input: JSON.stringify(jobs.map(({ template, vars }) => ({ template, vars }))) }));
  const rows = [];
  for (const [i, { f, name, sw, template, vars }] of jobs.entries()) {
    const text = py[i];
    if (new Template(template).render(vars) !== text) console.error(`${f} ${sw} ${name}: @huggingface/jinja differs from jinja2; jinja2's kept`);
    rows.push([f, sw, name, 'chat', (await encode(tok, text)).join(' ')]);
    if (f === 'nano-v2') rows.push([f, sw, name, 'tekken', (await encode(tekken, text)).join(' ')]);
  }
  const head = '# format\tswitch\tcase\ttokenizer\tids (tools/make_chat_fixtures.js: jinja2, checked against @huggingface/jinja, + HF tokenizers)\n';
  fs.writeFileSync(path.join(FIX, 'expected.tsv'), head + rows.map((r) => r.join('\t')).join('\n') + '\n');
  console.error(`${path.join(FIX, 'expected.tsv')}: ${rows.length} renderings`);
}

main();
