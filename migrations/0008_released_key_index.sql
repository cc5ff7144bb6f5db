-- The messages of one business key, for the console's key page and
-- key_messages.sql: pending rows and parked rows that hold their key are in
-- deferred_message_key_order, rejected rows in deferred_message_rejected_key,
-- but parked rows that released their key (park_holds_key false: a policy
-- without hold, or park --release) were in no index by key, so listing one
-- key read every parked row (0.2 s per 50,000). Such rows are few, and the
-- service's hot path (pending rows) never enters this index.
--
-- CREATE INDEX reads the whole table and blocks writes to it while it
-- does: about a second per million rows.
CREATE INDEX deferred_message_released_key
    ON deferred_message (business_key)
    WHERE state = 'parked' AND NOT park_holds_key;
