// Loaded with `node --require bench/loopback-preload.cjs ...` by bench/run.py: every TCP listen()
// in the process binds 127.0.0.1, whatever host (or none) the program asked for.  supergateway
// 4.0.0 has no --host option and calls httpServer.listen(port, cb), i.e. all interfaces.
// Unix-socket listens (a path string) and fd handles pass through unchanged.
'use strict';
const net = require('net');

const HOST = '127.0.0.1';
const original = net.Server.prototype.listen;

function isPort(value) {
  return typeof value === 'number' || (typeof value === 'string' && /^\d+$/.test(value));
}

net.Server.prototype.listen = function patchedListen(...args) {
  const first = args[0];
  if (first !== null && typeof first === 'object' && !Array.isArray(first)) {
    if (first.path === undefined && first.fd === undefined && first._handle === undefined &&
        first.handle === undefined) {
      args[0] = { ...first, host: HOST };
    }
  } else if (isPort(first) || first === undefined || typeof first === 'function') {
    const port = isPort(first) ? Number(first) : 0;
    const rest = isPort(first) ? args.slice(1) : args;
    // listen(port[, host][, backlog][, cb]): drop a caller's host, keep backlog and callback.
    if (typeof rest[0] === 'string') rest.shift();
    args = [port, HOST, ...rest];
  }
  return original.apply(this, args);
};
