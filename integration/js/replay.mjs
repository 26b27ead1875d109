// Drives iceberg-js (which sends its own UUIDv7 Idempotency-Key on every
// mutation) through the iceberg_idempotency proxy, then plays the client
// whose answer to createTable was lost: it resends the very request
// iceberg-js made — same URL, method, headers (so the same key) and body —
// with plain fetch. Prints one JSON document on stdout for the Go test
// (integration/clients_node_test.go), including every response seen, so that
// the Go side can validate them against the REST spec.
//
// usage: node replay.mjs <proxy base URL> [warehouse]
import { IcebergRestCatalog } from 'iceberg-js'

const [baseUrl, warehouse] = process.argv.slice(2)
if (!baseUrl) {
  console.error('usage: node replay.mjs <proxy base URL> [warehouse]')
  process.exit(2)
}

const exchanges = []
let createTableRequest = null

function headerObject(headers) {
  const out = {}
  for (const [k, v] of new Headers(headers ?? {})) out[k] = v
  return out
}

// Sends one request and records it with its answer. The body is read here
// and handed back in a fresh Response, so iceberg-js sees it unchanged.
async function recordedFetch(url, init = {}) {
  const method = (init.method ?? 'GET').toUpperCase()
  const res = await fetch(url, init)
  const body = await res.text()
  const ex = {
    method,
    url: String(url),
    requestHeaders: headerObject(init.headers),
    requestBody: typeof init.body === 'string' ? init.body : null,
    status: res.status,
    headers: headerObject(res.headers),
    body,
  }
  exchanges.push(ex)
  const path = new URL(String(url)).pathname
  if (method === 'POST' && /\/namespaces\/[^/]+\/tables$/.test(path) && createTableRequest === null) {
    createTableRequest = ex
  }
  return new Response(res.status === 204 || res.status === 304 ? null : body, {
    status: res.status,
    statusText: res.statusText,
    headers: res.headers,
  })
}

async function main() {
  const catalog = new IcebergRestCatalog({
    baseUrl,
    warehouse: warehouse || undefined,
    auth: { type: 'none' },
    fetch: recordedFetch,
  })

  const namespace = { namespace: ['js_ns'] }
  await catalog.createNamespace(namespace, { properties: { owner: 'iceberg-js' } })
  await catalog.createTable(namespace, {
    name: 'js_table',
    schema: {
      type: 'struct',
      'schema-id': 0,
      fields: [
        { id: 1, name: 'id', type: 'long', required: true },
        { id: 2, name: 'data', type: 'string', required: false },
      ],
    },
  })
  if (createTableRequest === null) throw new Error('iceberg-js sent no createTable request')

  // The retry of a client that never saw the answer: byte for byte the
  // same request, same Idempotency-Key.
  const orig = createTableRequest
  const retry = await recordedFetch(orig.url, {
    method: orig.method,
    headers: orig.requestHeaders,
    body: orig.requestBody,
  })
  const resent = exchanges[exchanges.length - 1]

  const createNamespace = exchanges.find((e) => e.method === 'POST' && /\/namespaces$/.test(new URL(e.url).pathname))
  console.log(
    JSON.stringify({
      createNamespace: {
        status: createNamespace?.status,
        key: createNamespace?.requestHeaders['idempotency-key'] ?? null,
      },
      createTable: {
        url: orig.url,
        method: orig.method,
        key: orig.requestHeaders['idempotency-key'] ?? null,
        status: orig.status,
        replayed: orig.headers['idempotent-replayed'] ?? null,
        body: orig.body,
      },
      resent: {
        key: resent.requestHeaders['idempotency-key'] ?? null,
        status: retry.status,
        replayed: resent.headers['idempotent-replayed'] ?? null,
        body: resent.body,
      },
      exchanges,
    }),
  )
}

main().catch((err) => {
  console.error(err?.stack ?? String(err))
  if (err?.details) console.error(JSON.stringify(err.details))
  process.exit(1)
})
