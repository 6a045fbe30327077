#!/usr/bin/env node
// meshllm from Node.js: stream a chat through the frontend's Inference service,
// then ask the Router which worker would serve a prompt, and why.
//
//   node example.js --inference 127.0.0.1:8001 --router 127.0.0.1:9000 [--model NAME]
//                   [--prompt TEXT] [--max-tokens N] [--token-ids 1,2,3]
//                   [--weather-tool [--tool-choice auto|none|required|get_weather]]
//
// --weather-tool offers a get_weather(city) function: the calls the model makes
// stream as pieces (id and name first, then arguments) and are printed whole;
// reasoning (with a frontend reasoning parser) is printed apart from the text.
//
// Addresses also come from MESHLLM_INFERENCE_ADDRESS / MESHLLM_ROUTER_ADDRESS.
// The stubs are built at run time from protos/meshllm/v1/*.proto with
// @grpc/proto-loader (include dir = protos/, so imports like
// "meshllm/v1/generate.proto" resolve); MESHLLM_PROTOS points elsewhere.
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTOS = process.env.MESHLLM_PROTOS || path.resolve(__dirname, '..', '..', 'protos');

function options() {
  const { values } = parseArgs({
    options: {
      inference: { type: 'string', default: process.env.MESHLLM_INFERENCE_ADDRESS || '127.0.0.1:8001' },
      router: { type: 'string', default: process.env.MESHLLM_ROUTER_ADDRESS || '127.0.0.1:9000' },
      model: { type: 'string', default: process.env.MESHLLM_MODEL || '' },
      prompt: { type: 'string', default: 'Write a haiku about a mesh of small services.' },
      'max-tokens': { type: 'string', default: '32' },
      'token-ids': { type: 'string', default: '' },
      'timeout-s': { type: 'string', default: '60' },
      'weather-tool': { type: 'boolean', default: false },
      'tool-choice': { type: 'string', default: 'auto' },
    },
  });
  return values;
}

// Every meshllm.v1 service, loaded from the .proto files themselves.
function loadMeshllm() {
  const dir = path.join(PROTOS, 'meshllm', 'v1');
  const files = fs.readdirSync(dir).filter((f) => f.endsWith('.proto')).map((f) => `meshllm/v1/${f}`);
  const definition = protoLoader.loadSync(files, {
    includeDirs: [PROTOS],
    keepCase: true, // field names exactly as in the .proto (token_ids, finish_reason)
    longs: String, // uint64 fields arrive as decimal strings
    enums: String, // enum values arrive as their names (FINISH_REASON_LENGTH)
    defaults: true,
  });
  return grpc.loadPackageDefinition(definition).meshllm.v1;
}

function deadline(seconds) {
  return new Date(Date.now() + seconds * 1000);
}

function unary(client, method, request, seconds) {
  return new Promise((resolve, reject) => {
    client[method](request, { deadline: deadline(seconds) }, (err, response) => (err ? reject(err) : resolve(response)));
  });
}

// Stream a chat; print text as it arrives. Resolves with the terminal chunk and every generated token id.
function streamChat(inference, request, seconds) {
  return new Promise((resolve, reject) => {
    const call = inference.ChatCompletion(request, { deadline: deadline(seconds) });
    const tokenIds = [];
    const calls = new Map(); // tool calls by index, their pieces put together
    let terminal = null;
    call.on('data', (chunk) => {
      if (chunk.reasoning) process.stdout.write(`[reasoning: ${chunk.reasoning}]`);
      if (chunk.text) process.stdout.write(chunk.text);
      for (const piece of chunk.tool_calls) {
        const c = calls.get(piece.index) || { id: '', name: '', arguments: '' };
        calls.set(piece.index, { id: c.id || piece.id, name: c.name || piece.name, arguments: c.arguments + piece.arguments });
      }
      tokenIds.push(...chunk.token_ids);
      if (chunk.finish_reason !== 'FINISH_REASON_UNSPECIFIED') terminal = chunk;
    });
    call.on('error', reject);
    call.on('end', () => resolve({ terminal, tokenIds, calls }));
  });
}

async function main() {
  const opts = options();
  const seconds = Number(opts['timeout-s']);
  const v1 = loadMeshllm();
  const inference = new v1.Inference(opts.inference, grpc.credentials.createInsecure());
  const router = new v1.Router(opts.router, grpc.credentials.createInsecure());
  try {
    let model = opts.model;
    if (!model) {
      const { models } = await unary(inference, 'ListModels', {}, seconds);
      if (models.length === 0) throw new Error(`no model is served at ${opts.inference}`);
      model = models[0].id;
    }
    console.log(`model: ${model}`);

    const request = { model, messages: [{ role: 'user', content: opts.prompt }], params: { max_tokens: Number(opts['max-tokens']) } };
    if (opts['weather-tool']) {
      const parameters = { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] };
      request.tools = [{ name: 'get_weather', description: 'The current weather in a city.', parameters: JSON.stringify(parameters) }];
      const modes = { auto: 'MODE_AUTO', none: 'MODE_NONE', required: 'MODE_REQUIRED' };
      const choice = opts['tool-choice'];
      request.tool_choice = choice in modes ? { mode: modes[choice] } : { function: choice };
    }
    process.stdout.write('text: ');
    const { terminal, tokenIds, calls } = await streamChat(inference, request, seconds);
    process.stdout.write('\n');
    for (const [, c] of [...calls.entries()].sort((a, b) => a[0] - b[0])) {
      console.log(`tool_call: ${c.name} ${c.arguments} id=${c.id}`);
    }
    if (terminal === null) throw new Error('the stream ended without a terminal chunk');
    if (terminal.finish_reason === 'FINISH_REASON_ERROR') {
      throw new Error(`generation failed: ${terminal.error.code}: ${terminal.error.message}`);
    }
    const usage = terminal.usage || {};
    const reason = terminal.finish_reason + (terminal.tool_calls_finished ? ' (tool_calls)' : '');
    console.log(`finish_reason: ${reason} prompt_tokens=${usage.prompt_tokens} completion_tokens=${usage.completion_tokens}`);

    // Which worker would serve a prompt made of these token ids (default: what the chat produced)?
    const given = opts['token-ids'].split(',').filter((s) => s.trim() !== '').map(Number);
    const routeIds = given.length > 0 ? given : tokenIds;
    const decision = await unary(router, 'Route', { model, token_ids: routeIds }, seconds);
    console.log(
      `route: worker_id=${decision.worker_id} address=${decision.address} role=${decision.role} ` +
        `policy=${decision.policy} prompt_blocks=${decision.prompt_blocks}`,
    );
    for (const c of decision.candidates) {
      console.log(
        `  candidate ${c.worker_id} overlap_blocks=${c.overlap_blocks} prefill_tokens=${c.prefill_tokens} ` +
          `decode_blocks=${c.decode_blocks} cost=${c.cost}`,
      );
    }

    const { workers } = await unary(router, 'ListWorkers', { model }, seconds);
    for (const w of workers) {
      console.log(`worker: ${w.worker_id} ${w.role} ${w.address} active_blocks=${w.active_blocks}/${w.total_blocks} in_flight=${w.in_flight}`);
    }
  } finally {
    inference.close();
    router.close();
  }
}

main().catch((err) => {
  console.error(`example.js: ${err.message}`);
  process.exit(1);
});
