package keystate

// The blocked-key set: rather than ask about the keys of every batch, a
// consumer loads its group's blocked keys once (SetPath, page by page) and
// follows what changes (ChangesPath). The database then works per deferral
// and release, not per main-topic record (docs/design.md, "The blocked-key
// set"). Both are POST with a JSON body, signed like Path's requests, and
// refused and answered 503 as it is.
const (
	// SetPath serves one page of a group's blocked keys.
	SetPath = "/v1/key-set"
	// ChangesPath serves the keys whose state changed since a cursor.
	ChangesPath = "/v1/key-changes"
)

// Limits of the set's requests.
const (
	// MaxSetPage is the most keys a SetRequest may ask for per page, and
	// what the server gives when it says nothing.
	MaxSetPage = 10_000
	// MaxChanges is the most changed keys a ChangesResponse carries; past
	// it the answer is Reset.
	MaxChanges = 10_000
)

// SetRequest asks for one page of Group's blocked keys, in byte order.
type SetRequest struct {
	Group string `json:"group"`
	// After is the last key of the previous page (SetResponse.Next); ""
	// for the first page.
	After string `json:"after,omitempty"`
	// Limit bounds the page (0: MaxSetPage).
	Limit int `json:"limit,omitempty"`
	// Wait and WaitMillis are as in Request, for the first page only: by
	// default the server waits until ingest has stored everything
	// produced to the defer topic before the request, so that the set
	// holds every deferral made before it (a new owner's predecessor's);
	// WaitPositions (with no positions) answers at once.
	Wait       string `json:"wait,omitempty"`
	WaitMillis int    `json:"wait_ms,omitempty"`
}

// SetResponse is one page of blocked keys, each with its state.
type SetResponse struct {
	Keys []State `json:"keys"`
	// Next is the key to give as After for the next page; "" on the last.
	Next string `json:"next,omitempty"`
	// Cursor is where to follow the set from (ChangesRequest.Cursor): a
	// client keeps the first page's, which covers what changed while it
	// read the others.
	Cursor string `json:"cursor"`
}

// ChangesRequest asks what changed in Group's blocked keys since Cursor.
type ChangesRequest struct {
	Group  string `json:"group"`
	Cursor string `json:"cursor"`
	// Keys are keys whose state to give as well, read at the same moment
	// as Stored: a client's own deferrals, which it keeps blocked until
	// Stored covers them (at most MaxKeys).
	Keys []string `json:"keys,omitempty"`
	// Positions, when given, are one per key of Keys: where the client's
	// deferral of the key went in the defer topic. A key is then answered
	// only once ingest has stored past its position, so that each
	// deferral's state is read once rather than at every question.
	Positions []Position `json:"positions,omitempty"`
}

// Position is where a record went in the defer topic.
type Position struct {
	Partition int32 `json:"partition"`
	Offset    int64 `json:"offset"`
}

// ChangesResponse answers a ChangesRequest.
type ChangesResponse struct {
	// Cursor is where to ask from next.
	Cursor string `json:"cursor"`
	// Reset says the set cannot be followed from the request's cursor
	// (changes were pruned, or too many came): load it again from the
	// first page. Keys is empty then.
	Reset bool `json:"reset,omitempty"`
	// Keys are the state now of every key that changed since the cursor,
	// free ones included, and of the request's Keys.
	Keys []State `json:"keys"`
	// Stored is how far ingest had stored each partition of the defer
	// topic when Keys were read: a record below it is in their state.
	Stored map[int32]int64 `json:"stored,omitempty"`
	// BehindMillis is how long the oldest change this answer could not
	// give yet has waited: changes come once every older transaction has
	// ended, and a transaction left open holds them back. A client stops
	// trusting its set when it grows.
	BehindMillis int64 `json:"behind_ms,omitempty"`
}
