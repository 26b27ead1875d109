package sqlstore

import "sync"

// Wakers is the registry a change listener (PostgreSQL LISTEN, Redis
// Pub/Sub) keeps of the Awaits it may wake: per key, one channel that is
// closed on the key's next change, shared by every Await of that key. The
// zero value is ready to use.
type Wakers struct {
	mu   sync.Mutex
	keys map[string]*wakers
}

type wakers struct {
	ch chan struct{} // closed on a change of the key
	n  int           // subscribers holding ch
}

// Subscribe returns a channel closed at the next change of key, and a func
// that unregisters it; it fits SubscribeFunc.
func (w *Wakers) Subscribe(key string) (<-chan struct{}, func()) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.keys == nil {
		w.keys = make(map[string]*wakers)
	}
	k := w.keys[key]
	if k == nil {
		k = &wakers{ch: make(chan struct{})}
		w.keys[key] = k
	}
	k.n++
	return k.ch, func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		k.n--
		if k.n == 0 && w.keys[key] == k {
			delete(w.keys, key)
		}
	}
}

// Wake wakes the Awaits of key.
func (w *Wakers) Wake(key string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if k := w.keys[key]; k != nil {
		close(k.ch)
		delete(w.keys, key)
	}
}

// WakeAll wakes every Await, to re-check after changes may have been
// missed (the listener's connection was down).
func (w *Wakers) WakeAll() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for key, k := range w.keys {
		close(k.ch)
		delete(w.keys, key)
	}
}
