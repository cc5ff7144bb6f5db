package keygate

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/keystate"
	"github.com/deferq/scheduler/sql/queries"
)

// ServeSet answers one page of a group's blocked keys (POST
// keystate.SetPath): refusals as ServeHTTP's; the first page waits for
// ingest as a key-state request does, unless it says "wait": "positions";
// then 200 with the page (key_set.sql).
func (s *Server) ServeSet(w http.ResponseWriter, r *http.Request) {
	body, ok := s.readBody(w, r, "key-set query", keystate.SetPath)
	if !ok {
		return
	}
	var req keystate.SetRequest
	if why := decodeStrict(body, &req, "key-set request"); why != "" {
		s.refuse(w, r, http.StatusBadRequest, why)
		return
	}
	if why := checkSetRequest(req); why != "" {
		s.refuse(w, r, http.StatusBadRequest, why)
		return
	}
	if req.After == "" && req.Wait != keystate.WaitPositions {
		wait := s.cfg.Wait
		if req.WaitMillis > 0 {
			wait = time.Duration(req.WaitMillis) * time.Millisecond
		}
		if why := s.catchUp(r.Context(), wait); why != "" {
			s.unsure(w, r, req.Group, why)
			return
		}
	}
	limit := req.Limit
	if limit == 0 {
		limit = keystate.MaxSetPage
	}
	ctx, cancel := context.WithTimeout(r.Context(), queryGrace)
	defer cancel()
	rows, err := queries.KeySet(ctx, s.cfg.DB, queries.KeySetParams{Group: req.Group, After: req.After, Limit: limit})
	if err != nil || len(rows) == 0 {
		s.unsure(w, r, req.Group, fmt.Sprintf("database: reading the blocked keys: %v", err))
		return
	}
	resp := keystate.SetResponse{Keys: []keystate.State{}, Cursor: strconv.FormatInt(rows[0].Cursor, 10)}
	for _, row := range rows {
		if row.BusinessKey == nil || row.Blocked == nil || !*row.Blocked {
			// No key, or one freed between the list and its state.
			continue
		}
		resp.Keys = append(resp.Keys, keystate.State{Key: *row.BusinessKey, Blocked: true, Reason: deref(row.Reason),
			HeadSeq: deref(row.HeadSeq), HeadID: deref(row.HeadID)})
	}
	if len(rows) >= limit && rows[len(rows)-1].BusinessKey != nil {
		resp.Next = *rows[len(rows)-1].BusinessKey
	}
	writeJSON(w, http.StatusOK, resp)
	s.cfg.Metrics.KeySetRequest("set", "answered")
}

// ServeChanges answers what changed in a group's blocked keys since a
// cursor (POST keystate.ChangesPath): refusals as ServeHTTP's; then 200
// with the changes (key_changes.sql), at once: it never waits for ingest.
func (s *Server) ServeChanges(w http.ResponseWriter, r *http.Request) {
	body, ok := s.readBody(w, r, "key-changes query", keystate.ChangesPath)
	if !ok {
		return
	}
	var req keystate.ChangesRequest
	if why := decodeStrict(body, &req, "key-changes request"); why != "" {
		s.refuse(w, r, http.StatusBadRequest, why)
		return
	}
	cursor, why := checkChangesRequest(req)
	if why != "" {
		s.refuse(w, r, http.StatusBadRequest, why)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), queryGrace)
	defer cancel()
	params := queries.KeyChangesParams{Group: req.Group, Cursor: cursor, Keys: req.Keys, Topic: s.cfg.Topic,
		Limit: keystate.MaxChanges}
	for _, pos := range req.Positions {
		params.Partitions = append(params.Partitions, pos.Partition)
		params.Offsets = append(params.Offsets, pos.Offset)
	}
	if params.Partitions == nil {
		params.Keys = distinct(req.Keys)
	}
	rows, err := queries.KeyChanges(ctx, s.cfg.DB, params)
	if err != nil || len(rows) == 0 {
		s.unsure(w, r, req.Group, fmt.Sprintf("database: reading the blocked keys' changes: %v", err))
		return
	}
	head := rows[0]
	resp := keystate.ChangesResponse{Cursor: strconv.FormatInt(head.Cursor, 10), Reset: head.Reset, Keys: []keystate.State{},
		Stored: make(map[int32]int64, len(head.StoredPartitions)), BehindMillis: head.BehindMillis}
	for i, part := range head.StoredPartitions {
		resp.Stored[part] = head.StoredOffsets[i]
	}
	for _, row := range rows {
		if row.BusinessKey == nil || row.Blocked == nil {
			continue
		}
		st := keystate.State{Key: *row.BusinessKey, Blocked: *row.Blocked}
		if st.Blocked {
			st.Reason, st.HeadSeq, st.HeadID = deref(row.Reason), deref(row.HeadSeq), deref(row.HeadID)
		}
		resp.Keys = append(resp.Keys, st)
	}
	writeJSON(w, http.StatusOK, resp)
	result := "answered"
	if resp.Reset {
		result = "reset"
	}
	s.cfg.Metrics.KeySetRequest("changes", result)
}

// decodeStrict decodes body, one JSON object of the fields of v and no
// others, into v; it returns what is wrong, "" when nothing is.
func decodeStrict(body []byte, v any, what string) string {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return "the body is not a " + what + ": " + err.Error()
	}
	if _, err := dec.Token(); err != io.EOF {
		return "the body holds more than one JSON value"
	}
	if field := badText(body); field != "" {
		return field + " is not valid UTF-8"
	}
	return ""
}

// badText names the first string of a request body's fields (or of an
// array field, as name[i]) that encoding/json would have altered: not
// valid UTF-8, or a surrogate escape that does not pair up (see
// invalidText). "" when there is none.
func badText(body []byte) string {
	if utf8.Valid(body) && !bytes.Contains(body, []byte(`\ud`)) && !bytes.Contains(body, []byte(`\uD`)) {
		return ""
	}
	var fields map[string]json.RawMessage
	if json.Unmarshal(body, &fields) != nil {
		return ""
	}
	for _, name := range []string{"group", "after", "wait", "cursor", "keys"} {
		raw, ok := fields[name]
		if !ok {
			continue
		}
		var list []json.RawMessage
		if json.Unmarshal(raw, &list) == nil {
			for i, tok := range list {
				if !validText(tok) {
					return fmt.Sprintf("%s[%d]", name, i)
				}
			}
			continue
		}
		if !validText(raw) {
			return name
		}
	}
	return ""
}

// setQuery names the blocked-key set query a request is for, in metrics;
// "" for the key-state query.
func setQuery(r *http.Request) string {
	switch r.URL.Path {
	case keystate.SetPath:
		return "set"
	case keystate.ChangesPath:
		return "changes"
	}
	return ""
}

// checkGroup says what is wrong with a request's group, "" when nothing.
func checkGroup(group string) string {
	switch {
	case group == "":
		return "group is empty: name the consumer group the keys are asked for"
	case len(group) > protocol.MaxGroupBytes:
		return fmt.Sprintf("group is %d bytes, at most %d", len(group), protocol.MaxGroupBytes)
	}
	return ""
}

// checkKeys says what is wrong with a request's keys (too many, or one
// empty, too long, or in bad, the indexes of those that are not valid
// UTF-8 as sent), "" when nothing is.
func checkKeys(keys []string, bad map[int]bool) string {
	if len(keys) > keystate.MaxKeys {
		return fmt.Sprintf("keys holds %d keys, at most %d per request", len(keys), keystate.MaxKeys)
	}
	for i, k := range keys {
		switch {
		case k == "":
			return fmt.Sprintf("keys[%d] is empty", i)
		case len(k) > keystate.MaxKeyBytes:
			return fmt.Sprintf("keys[%d] is %d bytes, at most %d", i, len(k), keystate.MaxKeyBytes)
		case bad[i]:
			return fmt.Sprintf("keys[%d] is not valid UTF-8", i)
		}
	}
	return ""
}

// checkSetRequest says what is wrong with a key-set request, naming the
// field, "" when nothing is.
func checkSetRequest(req keystate.SetRequest) string {
	if why := checkGroup(req.Group); why != "" {
		return why
	}
	switch {
	case len(req.After) > keystate.MaxKeyBytes:
		return fmt.Sprintf("after is %d bytes, at most %d: give the last key of the previous page", len(req.After), keystate.MaxKeyBytes)
	case req.Limit < 0 || req.Limit > keystate.MaxSetPage:
		return fmt.Sprintf("limit is %d; want 0 (the server's default) to %d", req.Limit, keystate.MaxSetPage)
	case req.WaitMillis < 0 || req.WaitMillis > keystate.MaxWaitMillis:
		return fmt.Sprintf("wait_ms is %d; want 0 (the server's default) to %d", req.WaitMillis, keystate.MaxWaitMillis)
	case req.Wait != "" && req.Wait != keystate.WaitAll && req.Wait != keystate.WaitPositions:
		return fmt.Sprintf("wait is %q; want %q (the default) or %q", req.Wait, keystate.WaitAll, keystate.WaitPositions)
	case req.After != "" && (req.Wait != "" || req.WaitMillis != 0):
		return "wait and wait_ms go with the first page only (no after): later pages never wait"
	}
	return ""
}

// checkChangesRequest says what is wrong with a key-changes request,
// naming the field, "" when nothing is; and returns its cursor.
func checkChangesRequest(req keystate.ChangesRequest) (int64, string) {
	if why := checkGroup(req.Group); why != "" {
		return 0, why
	}
	cursor, err := strconv.ParseInt(req.Cursor, 10, 64)
	if err != nil || cursor < 0 {
		return 0, fmt.Sprintf("cursor is %q; want the cursor of the last answer (%s or %s), a number", req.Cursor, keystate.SetPath, keystate.ChangesPath)
	}
	if why := checkKeys(req.Keys, nil); why != "" {
		return 0, why
	}
	if len(req.Positions) > 0 && len(req.Positions) != len(req.Keys) {
		return 0, fmt.Sprintf("positions holds %d positions for %d keys: give one per key, or none", len(req.Positions), len(req.Keys))
	}
	for i, pos := range req.Positions {
		if pos.Partition < 0 || pos.Offset < 0 {
			return 0, fmt.Sprintf("positions[%d] is partition %d, offset %d: want 0 or more", i, pos.Partition, pos.Offset)
		}
	}
	return cursor, ""
}
