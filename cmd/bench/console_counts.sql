-- The console scenario (cmd/bench/console.go): what the seed made, for the
-- report: messages, parked, rejected, keys (deferred_key rows: keys with
-- a head, and unordered pending messages) and history events (the view
-- deferred_history: deferred_attempt's rows, with the deferrals folded into
-- a delivery or not written yet counted as events of their own).
SELECT (SELECT count(*) FROM deferred_message),
       (SELECT count(*) FROM deferred_message WHERE state = 'parked'),
       (SELECT count(*) FROM deferred_message WHERE state = 'rejected'),
       (SELECT count(*) FROM deferred_key),
       (SELECT count(*) FROM deferred_history)
